"""A datagen worker's garbage collector (factory/datagen/heap.py): the start-up heap frozen once, the young
generation's threshold raised (issue 33), never lowered, and left alone where the process turned collection off."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_the_young_threshold_is_raised_once_with_the_freeze():
    run("import gc; from factory.datagen.heap import YOUNG_THRESHOLD as y, freeze_startup_heap as f; "
        "assert gc.get_threshold() == (700, 10, 10); assert f(); assert gc.get_threshold() == (y, 10, 10); "
        "gc.set_threshold(900, 10, 10); assert not f() and gc.get_threshold() == (900, 10, 10)")


def test_a_higher_threshold_is_kept_and_collection_turned_off_stays_off():
    run("import gc; from factory.datagen.heap import YOUNG_THRESHOLD as y, freeze_startup_heap as f; "
        "gc.set_threshold(10 * y, 5, 5); f(); assert gc.get_threshold() == (10 * y, 5, 5)")
    run("import gc; from factory.datagen.heap import freeze_startup_heap as f; "
        "gc.set_threshold(0, 10, 10); f(); assert gc.get_threshold() == (0, 10, 10)")


def test_cycles_made_after_the_freeze_are_still_collected_without_a_call():
    run("import gc, weakref; from factory.datagen.heap import YOUNG_THRESHOLD as y, freeze_startup_heap as f; f()\n"
        "class Node: pass\n"
        "a, b = Node(), Node(); a.other, b.other = b, a; gone = weakref.ref(a); del a, b\n"
        "keep = [[] for _ in range(y // 2)]; assert gone() is not None\n"  # below the threshold: not yet
        "keep += [[] for _ in range(y)]; assert gone() is None")  # past it: a young collection freed the cycle
