"""A small store for the viewer's tests: two envs, InternBootcamp-style keys, policy versions, drops, a flow run id,
one group whose completion holds a <script> and one multimodal group with an image."""

from __future__ import annotations

import json
from pathlib import Path

from environments.groups import make_group_id
from factory.store import ShardStore
from factory.synthetic import synthetic_group

RED_PIXEL_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
SCRIPT = "<script>window.__xss = 1; document.title = 'pwned'</script><b>bold?</b>"
FLOW_RUN_ID = "0c5c0b1e-6a8e-4c52-9a51-7c3c8f6f1a01"
FAMILIES = ("arithmetic", "cipher", "sorting")


def make_group(index: int, run_id: str, policy_version: int, *, text: str | None = None, images=None):
    """Group `index`: family and difficulty from the index, scores that vary, readable messages."""
    if index % 5 == 4:
        env, key, family = "gsm8k", f"train-{index}", "gsm8k"
    else:
        env, family = "intern_bootcamp", FAMILIES[index % 3]
        key = f"{family}:{index % 4 + 1}:{index}"
    group = synthetic_group(index, group_size=4, seq_len=20 + index % 7, env=env, run_id=run_id,
                            policy_version=policy_version)
    scores = [1.0 if (index + k) % 3 == 0 else (0.0 if k % 2 else -0.5) for k in range(4)]
    if len(set(scores)) == 1:
        scores[0] = 0.5
    question = f"Question {index} ({family}): what is {index} plus one?"
    messages = [[{"role": "user", "content": question},
                 {"role": "assistant", "content": text if (text and k == 1) else f"The answer is {index + k}."}]
                for k in range(4)]
    return group.model_copy(update={"scores": scores, "messages": messages, "item_key": key, "images": images,
                                    "group_id": make_group_id(env, key, 0, policy_version)})


def make_viewer_store(root: Path, run_id: str = "run-1", chunks: int = 3, per_chunk: int = 20) -> ShardStore:
    """`chunks` shards of `per_chunk` groups; chunk k has policy version k; chunk stats with drops and a flow run id."""
    store = ShardStore(root)
    index = 0
    for chunk in range(chunks):
        groups = []
        for _ in range(per_chunk):
            if index == 7:
                groups.append(make_group(index, run_id, chunk, text=SCRIPT))
            elif index == 11:
                groups.append(make_group(index, run_id, chunk,
                                         images=[f"data:image/png;base64,{RED_PIXEL_PNG}", "https://evil.example/x.png"]))
            else:
                groups.append(make_group(index, run_id, chunk))
            index += 1
        write_chunk(store, run_id, chunk, groups)
    return store


def write_chunk(store: ShardStore, run_id: str, chunk: int, groups: list, producer: str = "datagen") -> None:
    stats = {"groups_kept": len(groups), "dropped": {"failed": 1, "wrong_size": 0, "too_long": chunk, "equal_scores": 3},
             "chunk": chunk, "flow_run_id": FLOW_RUN_ID}
    store.write_run_file(run_id, f"stats-{producer}-{chunk:08d}.json", json.dumps(stats))
    store.commit(run_id, producer, chunk, groups)
