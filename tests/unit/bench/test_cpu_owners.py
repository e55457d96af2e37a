"""bench.datagen.cpu_owners: each py-spy sample goes to the data-path stage it is in, else Prefect, else the flow's
bookkeeping; the bench's own work is left out."""

from __future__ import annotations

from bench.datagen.cpu_owners import owner, owners

MAIN = "<module> (bench/datagen/flow_profile.py:366);main (bench/datagen/flow_profile.py:189);" \
       "factory_flow (bench/datagen/run.py:162)"
IN_FLOW = MAIN + ";Flow.__call__ (prefect/flows.py:1887);run_flow (prefect/flow_engine.py:2268);" \
                 "intern_bootcamp_datagen (flows/datagen.py:131);datagen_pipeline (flows/datagen.py:56)"
TASK = "Thread._bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:83);" \
       "run_task_sync (prefect/task_engine.py:1696);rollout_chunks (tasks/rollout.py:65);" \
       "rollout_chunk (tasks/rollout.py:56)"


def frames(stack: str) -> list[str]:
    return stack.split(";")


def test_a_stage_is_the_deepest_stage_frame_of_the_stack():
    assert owner(frames(TASK + ";score_generated (tasks/score.py:78);score_item (tasks/scoring_pool.py:40);"
                               "InternBootcampEnv.score (environments/intern_bootcamp.py:133)")) == "score"
    assert owner(frames(TASK + ";generate_chunk (tasks/generate.py:294);"
                               "InternBootcampEnv.get_item (environments/intern_bootcamp.py:89)")) == "generate"
    assert owner(frames("Thread._bootstrap (threading.py:1002);_SamplingLoop._serve (tasks/generate.py:215);"
                        "run (asyncio/runners.py:190);KeepAliveHttp._exchange (factory/inference/http_pool.py:128)"
                        )) == "generate"
    assert owner(frames(TASK + ";group_generated (tasks/group.py:253);GroupColumns.add (factory/group_columns.py:141)"
                        )) == "group"
    commit = IN_FLOW + ";DatagenRun._commit (factory/datagen/run.py:363);write_shard (tasks/shards.py:50)"
    assert owner(frames(commit + ";ShardStore.commit (factory/store.py:843);"
                                 "GroupedChunk.to_record_batch (tasks/group.py:62)")) == "commit"  # the Arrow build


def test_outside_the_stages_prefect_then_the_flows_bookkeeping_then_other():
    assert owner(frames(TASK[:TASK.index(";rollout_chunks")] + ";Logger.log (logging/__init__.py:1559)")) == "Prefect"
    assert owner(frames("Thread._bootstrap (threading.py:1002);EventLoopThread._entrypoint "
                        "(prefect/_internal/concurrency/threads.py:272);Client.send (httpx/_client.py:914)")) == "Prefect"
    assert owner(frames(IN_FLOW + ";DatagenRun.plan_next (factory/datagen/run.py:306)")) == "flow bookkeeping"
    assert owner(frames(TASK)) == "chunk hand-over"  # the rollout task between steps: freeing a chunk's rollouts
    assert owner(frames("Thread._bootstrap (threading.py:1002);Thread.run (threading.py:982)")) == "other"


def test_the_benchs_own_work_and_idle_leaves_are_left_out():
    assert owner(frames(MAIN + ";content_hash (bench/datagen/stages.py:175);"
                               "ShardStore.dataset (factory/store.py:500)")) is None
    assert owner(frames(TASK + ";Condition.wait (threading.py:327)")) is None
    assert owner([]) is None


def test_owners_counts_raw_lines_and_the_leaves_of_orchestration():
    lines = [IN_FLOW + ";DatagenRun.plan_next (factory/datagen/run.py:306) 3\n",
             TASK + ";score_generated (tasks/score.py:78) 5\n",
             "garbage without a count\n"]
    by_owner, leaves = owners(lines)
    assert by_owner == {"flow bookkeeping": 3, "score": 5}
    assert leaves["flow bookkeeping"] == {"DatagenRun.plan_next (factory/datagen/run.py:306)": 3}
