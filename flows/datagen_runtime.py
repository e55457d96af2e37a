"""Moved to factory.datagen.runtime (task runners), .endpoints and .backpressure; names kept for old imports."""

from factory.datagen.backpressure import Backpressure  # noqa: F401
from factory.datagen.endpoints import use_endpoints_block  # noqa: F401
from factory.datagen.runtime import (PROJECT_ROOT, TASK_RUNNERS, check_importable_by_workers,  # noqa: F401
                                     make_task_runner)
