"""The one place a datagen run's inference endpoints are chosen.

`openai.base_url` from the config, unless `datagen.endpoints_block` names an
InferenceEndpointsBlock (saved by the sglang-on-slurm flow): then that block's
servers. The CLI and the flow both call `choose_endpoints` before preflight,
so preflight checks the endpoints that will be sampled.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def use_endpoints_block(cfg: Any) -> None:
    """Point `cfg.openai` at the endpoints of the block named in `datagen.endpoints_block`, keeping its other settings.

    The sglang-on-slurm flow saves its servers (or router) as such a block, so a datagen deployment samples
    from whatever that flow started without a parameter change.
    """
    name = cfg.datagen.endpoints_block
    if not name:
        return
    from blocks.inference import InferenceEndpointsBlock

    block = InferenceEndpointsBlock.load(name)
    update = {"base_url": block.base_urls, "server_type": block.server_type, "api_key": block.api_key.get_secret_value(),
              "num_max_requests_at_once": block.num_max_requests_at_once}
    if block.model_name != "default":
        update["model_name"] = block.model_name
    cfg.openai = type(cfg.openai).model_validate({**cfg.openai.model_dump(), **update})
    logger.info("sampling from the endpoints of block %r: %s", name, cfg.openai.base_url)


def choose_endpoints(cfg: Any) -> None:
    """Settle `cfg.openai` on the endpoints this run samples from (the block's, when one is named)."""
    use_endpoints_block(cfg)
