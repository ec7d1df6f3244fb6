"""Driver-side checkpoint pieces without engines: discovery, atomic commit, pruning, metrics on resume, and the
prompt stream continuing where the interrupted run left it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slimish import run_layout
from slimish.config.errors import ConfigError
from slimish.errors import UserError
from slimish.orchestration import checkpoints
from slimish.orchestration.metrics import truncate_metrics
from slimish.rollout.data import PromptDataset


def _save(run_dir, step: int, **extra) -> None:
    staging = checkpoints.begin(run_dir, step)
    (staging / run_layout.TRAINER_DIR).mkdir()
    checkpoints.commit(staging, {"step": step, "weight_version": step, **extra})


def test_auto_resume_picks_the_newest_complete_checkpoint(tmp_path):
    assert checkpoints.resume_path("auto", tmp_path) is None
    for step in (2, 9, 10):
        _save(tmp_path, step)
    assert [s for s, _ in run_layout.complete_checkpoints(tmp_path)] == [2, 9, 10]  # numeric, not lexical
    assert checkpoints.resume_path("auto", tmp_path) == tmp_path / "checkpoints" / "step_10"
    assert checkpoints.resume_path("never", tmp_path) is None
    explicit = tmp_path / "checkpoints" / "step_9"
    assert checkpoints.resume_path(str(explicit), tmp_path) == explicit
    assert checkpoints.read_driver_state(explicit)["step"] == 9


def test_an_interrupted_save_is_never_resumed_from_and_is_cleaned_up(tmp_path):
    _save(tmp_path, 1)
    staging = checkpoints.begin(tmp_path, 2)  # killed while the trainer was writing
    (staging / run_layout.TRAINER_DIR).mkdir()
    root = tmp_path / "checkpoints"
    (root / "step_3").mkdir()  # a directory that merely looks like a checkpoint (no driver.json)
    (root / "step_3" / run_layout.TRAINER_DIR).mkdir()
    assert checkpoints.resume_path("auto", tmp_path) == root / "step_1"
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        checkpoints.resume_path(str(root / "step_3"), tmp_path)
    _save(tmp_path, 4)
    assert not staging.exists()
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_3", "step_4"]


def test_commit_replaces_a_checkpoint_of_the_same_step(tmp_path):
    _save(tmp_path, 5, note="first")
    _save(tmp_path, 5, note="second")
    assert checkpoints.read_driver_state(tmp_path / "checkpoints" / "step_5")["note"] == "second"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_5"]


class Crash(Exception):
    pass


@pytest.mark.parametrize("crash_before,survivor", [(1, "first"), (2, "first"), (3, "second")],
                         ids=["old-moved-aside", "new-renamed-in", "old-deleted"])
def test_a_crash_while_a_step_is_resaved_always_leaves_a_complete_copy(tmp_path, monkeypatch, crash_before,
                                                                       survivor):
    """Re-saving step 5 is three operations (the old step_5 renamed aside, the new one renamed in, the old one
    deleted); a crash before any of them leaves a complete step 5 that auto-resume finds, and the next save puts
    things in order. On main at a706c6e a crash before the second left no step 5 at all (the old copy under a
    `.partial-` name, which the next save deleted)."""
    import pathlib
    import shutil

    _save(tmp_path, 5, note="first")
    staging = checkpoints.begin(tmp_path, 5)
    (staging / run_layout.TRAINER_DIR).mkdir()
    (staging / run_layout.TRAINER_DIR / "shard.bin").write_bytes(b"new weights")
    done = []

    def counted(original):
        def operation(*args, **kwargs):
            if len(done) + 1 == crash_before:
                raise Crash(f"the job died before operation {crash_before}")
            done.append(original.__name__)
            return original(*args, **kwargs)
        return operation

    monkeypatch.setattr(pathlib.Path, "rename", counted(pathlib.Path.rename))
    monkeypatch.setattr(shutil, "rmtree", counted(shutil.rmtree))
    with pytest.raises(Crash):
        checkpoints.commit(staging, {"step": 5, "weight_version": 5, "note": "second"})
    monkeypatch.undo()
    (step, path), = run_layout.complete_checkpoints(tmp_path)
    assert step == 5 and checkpoints.read_driver_state(path)["note"] == survivor
    assert checkpoints.resume_path("auto", tmp_path) == path
    _save(tmp_path, 6)  # the next save puts the survivor back under its name and clears what is left
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_5", "step_6"]
    assert checkpoints.read_driver_state(root / "step_5")["note"] == survivor


def test_prune_keeps_the_newest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step)
    assert checkpoints.prune(tmp_path, 0) == []
    deleted = checkpoints.prune(tmp_path, 2)
    assert [p.name for p in deleted] == ["step_1", "step_2", "step_3"]
    assert [s for s, _ in run_layout.complete_checkpoints(tmp_path)] == [4, 5]


def test_resumed_metrics_drop_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3)))
    truncate_metrics(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    truncate_metrics(tmp_path / "absent.jsonl", 2)  # a fresh run directory: nothing to do


def test_a_resume_drops_a_cut_last_metrics_line_with_a_warning(tmp_path, caplog):
    """SIGKILL or a full disk in the middle of a record leaves half a line: the resume drops it (it never held a whole
    step), says so, and leaves a file the next record is appended to as a line of its own. On main at a706c6e it
    stopped the resume with a JSONDecodeError traceback."""
    path = tmp_path / "metrics.jsonl"
    whole = "".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2))
    path.write_text(whole + '{"step": 3, "x": 0.12')
    with caplog.at_level("WARNING"):
        truncate_metrics(path, 2)
    assert path.read_text() == whole
    assert "metrics.jsonl:3: the last line was cut" in caplog.text
    # Cut right before its newline: the record is whole and kept; the file gets its newline back.
    path.write_text(whole + json.dumps({"step": 3, "x": 3}))
    truncate_metrics(path, 5)
    assert path.read_text().endswith('"x": 3}\n') and len(path.read_text().splitlines()) == 3


def test_an_unreadable_metrics_line_before_the_last_names_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: cannot read this line"):
        truncate_metrics(path, 5)
    path.write_text('{"step": 1}\n["a list"]\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r'metrics\.jsonl:2: cannot read this line \(not a JSON object with'):
        truncate_metrics(path, 5)


def _dataset(path):
    return PromptDataset(str(path), tokenizer=lambda text: {"input_ids": [len(text)]}, prompt_key="prompt",
                         label_key="label", shuffle=True, seed=7)


def test_prompt_stream_continues_where_the_saved_state_left_it(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "label": i}) + "\n" for i in range(5)))
    uninterrupted = _dataset(path)
    first = uninterrupted.next_batch(3)
    state = json.loads(json.dumps(uninterrupted.state()))  # through driver.json
    expected = [p.text for p in uninterrupted.next_batch(4) + uninterrupted.next_batch(4)]  # crosses epochs
    resumed = _dataset(path)
    resumed.load_state(state)
    assert [p.text for p in resumed.next_batch(4) + resumed.next_batch(4)] == expected
    assert [p.text for p in _dataset(path).next_batch(4)] != expected[:4], "a fresh stream would repeat prompts"
    assert len(first) == 3


def test_rollout_manager_state_round_trips(tmp_path):
    from slimish.config.schema import JobConfig, PartialRolloutConfig
    from slimish.engines.generation import GenerationClient
    from slimish.rollout.generate import SamplingParams
    from slimish.rollout.manager import RolloutManager
    from slimish.rollout.scheduler import RolloutScheduler
    from slimish.sample import Status
    from tests.kit.samples import sample

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "label": i}) + "\n" for i in range(5)))
    managers = []
    cfg = JobConfig()  # the schema's defaults: only the rollout's sampling settings are read here
    for _ in range(2):  # without engines (the scheduler only contacts them to generate): the state it covers
        manager = RolloutManager(cfg, tokenizer=None, dataset=_dataset(path), reward=None, program=None,
                                 eval_sets=[], servers=None)
        engines = GenerationClient("http://127.0.0.1:9", request_timeout_s=1, max_concurrency=1)
        manager.scheduler = RolloutScheduler(
            engines=engines, engine_urls=[], params=SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0),
            prompts_per_step=1, partial=PartialRolloutConfig(mode="abort"), max_concurrency=1, max_retries=0,
            new_group=None, score=None, detokenize=None)
        managers.append(manager)
    managers[0].dataset.next_batch(7)
    managers[0].totals.update({"completed": 12, "reward_failures": 1})
    partial = sample(group_id=3, prompt="p3", prompt_ids=[1, 2], response_ids=[5], rollout_logprobs=-0.5,
                     weight_versions=2, status=Status.ABORTED, meta={"segments": 1})
    managers[0].scheduler.load_state({"next_group_id": 4, "groups": [{"group_id": 3, "samples": [partial.to_dict()]}]})
    try:
        managers[1].load_state(json.loads(json.dumps(managers[0].state())))
        assert managers[1].state() == managers[0].state()
        assert managers[1].state()["scheduler"]["groups"][0]["samples"][0] == partial.to_dict()
        assert managers[1].dataset.next_batch(3) == managers[0].dataset.next_batch(3)
    finally:
        for manager in managers:
            manager.scheduler.close()


def test_skipped_steps_are_said_and_too_many_in_a_row_stop_the_job():
    """The driver's rule (`RLJob.check_skipped_steps`), on the metrics the trainer reports: a step that skipped an
    optimizer step gets a console line; trainer.max_skipped_steps such steps in a row stop the job in one line; a
    good step resets the count; 0 never stops."""
    from types import SimpleNamespace

    from slimish.errors import UserError
    from slimish.orchestration.driver import RLJob

    def job(limit):
        said = []
        return SimpleNamespace(skipped_in_a_row=0, say=said.append, said=said,
                               cfg=SimpleNamespace(trainer=SimpleNamespace(max_skipped_steps=limit)))

    three = job(3)
    for step, skipped in ((1, 1), (2, 1), (3, 0), (4, 2), (5, 1)):
        RLJob.check_skipped_steps(three, step, skipped)
    assert three.said[0] == ("step 1: 1 optimizer step(s) skipped: the loss or gradient was not finite (NaN or inf); "
                             "the weights are unchanged by them") and len(three.said) == 4
    with pytest.raises(UserError, match=r"^steps 4-6 each had a loss or gradient that was not finite"):
        RLJob.check_skipped_steps(three, 6, 1)
    never = job(0)
    for step in range(1, 20):
        RLJob.check_skipped_steps(never, step, 1)
    assert len(never.said) == 19


def _run_saves(run_dir, resume: str, steps, *, other_runs: str = "refuse", keep_last: int = 2) -> str:
    """A job's checkpoint calls, as the driver makes them: its run id from `start_lineage`, then a save (and a
    prune) at each of `steps`; returns the run id."""
    lineage, _ = checkpoints.start_lineage(run_dir, resume, other_runs=other_runs)
    for step in steps:
        _save(run_dir, step, lineage=lineage)
        checkpoints.prune(run_dir, keep_last, lineage)
    return lineage


def test_a_new_run_never_prunes_or_resumes_another_runs_checkpoints(tmp_path):
    """On main at a706c6e a run with resume=never saved step_2 in a directory holding another run's steps 9 and 10,
    then pruned its own step_2 away (the highest steps were kept), and a later resume=auto went back to the other
    run's step 10. Now the new run stops in one line, naming the other run's steps, and nothing is touched."""
    old = _run_saves(tmp_path, "auto", [9, 10])
    (tmp_path / "metrics.jsonl").write_text('{"step": 10}\n')
    with pytest.raises(UserError) as refused:
        _run_saves(tmp_path, "never", [2])
    assert str(refused.value).startswith(f"{tmp_path} holds checkpoints of another run (steps 9, 10)")
    assert "checkpoint.other_runs=archive" in str(refused.value) and "\n" not in str(refused.value)
    assert [s for s, _ in run_layout.complete_checkpoints(tmp_path)] == [9, 10]
    assert checkpoints.current_lineage(tmp_path) == old  # the directory still continues the old run


def test_archived_another_runs_checkpoints_are_kept_apart_and_auto_follows_the_new_run(tmp_path):
    old = _run_saves(tmp_path, "auto", [9, 10])
    (tmp_path / "metrics.jsonl").write_text('{"step": 10}\n')
    new = _run_saves(tmp_path, "never", [1, 2, 3], other_runs="archive")
    assert new != old
    archive = tmp_path / run_layout.ARCHIVE / old
    assert sorted(p.name for p in archive.iterdir()) == ["metrics.jsonl", "step_10", "step_9"]
    assert checkpoints.read_driver_state(archive / "step_10")["lineage"] == old
    assert [s for s, _ in run_layout.complete_checkpoints(tmp_path)] == [2, 3]  # pruned to 2: the new run's own
    lineage, resume_from = checkpoints.start_lineage(tmp_path, "auto", other_runs="refuse")
    assert (lineage, resume_from) == (new, tmp_path / "checkpoints" / "step_3")


def test_deleted_another_runs_checkpoints_are_gone_and_an_earlier_directory_is_continued(tmp_path):
    _save(tmp_path, 4)  # a checkpoint from before run ids: no "lineage" in its driver.json
    lineage, resume_from = checkpoints.start_lineage(tmp_path, "auto", other_runs="refuse")
    assert (lineage, resume_from) == ("", tmp_path / "checkpoints" / "step_4")  # continued, not refused
    new = _run_saves(tmp_path, "never", [1], other_runs="delete")
    assert [(s, run_layout.lineage_of(p)) for s, p in run_layout.complete_checkpoints(tmp_path)] == [(1, new)]
    assert not (tmp_path / run_layout.ARCHIVE).exists()


def test_a_save_never_replaces_another_runs_checkpoint_of_the_same_step(tmp_path):
    _save(tmp_path, 5, lineage="run-a")
    staging = checkpoints.begin(tmp_path, 5)
    (staging / run_layout.TRAINER_DIR).mkdir()
    with pytest.raises(UserError, match="is a checkpoint of another run: it is not replaced"):
        checkpoints.commit(staging, {"step": 5, "weight_version": 5, "lineage": "run-b"})
    assert run_layout.lineage_of(tmp_path / "checkpoints" / "step_5") == "run-a"


def test_a_step_with_reward_failures_says_how_many_and_the_first_error():
    """`RLJob.say_reward_failures`: a hook with the wrong signature shows at step 1 in one console line (on main at
    a706c6e only metrics.jsonl counted it); a step without failures says nothing."""
    from types import SimpleNamespace

    from slimish.orchestration.driver import RLJob
    from slimish.sample import Sample

    said = []
    job = SimpleNamespace(say=said.append)
    ok, bad = (Sample(group_id=0, index=i, prompt="p", prompt_ids=[1]) for i in range(2))
    bad.error = "reward failed: TypeError: reward() got an unexpected keyword argument\n'labels'"
    RLJob.say_reward_failures(job, 1, 0, [ok])
    RLJob.say_reward_failures(job, 1, 3, [ok, bad, bad])
    assert said == ["step 1: 3 sample(s) failed their reward and were scored reward.failure_reward; the first: "
                    "reward failed: TypeError: reward() got an unexpected keyword argument 'labels'"]


def test_a_dead_jobs_disk_sync_directories_are_removed_at_the_next_start_and_no_other_runs(tmp_path):
    """A job killed in the middle of a disk-transport sync leaves a whole model copy (sync-*/); the next job of the
    run removes it (under the run directory's lock). Under a shared weight_sync.disk_dir each run has a directory
    of its own, so another run's shards are never touched."""
    from slimish.run_layout import remove_sync_leftovers, weight_sync_root

    run_a, run_b = tmp_path / "out" / "a", tmp_path / "other" / "a"  # same run name, two output directories
    assert weight_sync_root("", run_a) == run_a / "weight_sync"
    shared = tmp_path / "shared"
    root_a, root_b = weight_sync_root(str(shared), run_a), weight_sync_root(str(shared), run_b)
    assert root_a.parent == root_b.parent == shared and root_a != root_b
    for root in (root_a, root_b):
        (root / "sync-x1y2").mkdir(parents=True)
        (root / "sync-x1y2" / "model-00001.safetensors").write_bytes(b"0" * 64)
    (root_a / "notes.txt").write_text("not a sync directory")
    assert remove_sync_leftovers(root_a) == 1
    assert sorted(p.name for p in root_a.iterdir()) == ["notes.txt"] and (root_b / "sync-x1y2").is_dir()
    assert remove_sync_leftovers(tmp_path / "missing") == 0


class _BackgroundTrainer:
    """A trainer group's checkpoint calls: a background save's files appear at finish_checkpoint only (as Megatron's
    metadata.json does), a plain save's at once."""

    def __init__(self):
        self.calls, self.writing = [], None

    def call(self, method: str, *args):
        self.calls.append((method, *args))
        if method == "save_checkpoint":
            path, background = args
            Path(path).mkdir(parents=True)
            if background:
                self.writing = Path(path)
            else:
                (Path(path) / "metadata.json").write_text("{}")
        elif method == "finish_checkpoint" and self.writing is not None:
            (self.writing / "metadata.json").write_text("{}")
            self.writing = None


def _async_job(run_dir, keep_last: int = 1):
    from types import SimpleNamespace

    from slimish.orchestration.driver import RLJob

    cfg = SimpleNamespace(checkpoint=SimpleNamespace(keep_last=keep_last),
                          parallel=SimpleNamespace(tensor_parallel=1, pipeline_parallel=1, num_trainer_ranks=1))
    job = SimpleNamespace(run_dir=run_dir, cfg=cfg, lineage="r1", turns=None, pending_save=None,
                          trainer=_BackgroundTrainer(), said=[],
                          rollout_state=lambda: {"scheduler": {"groups": []}})
    job.say = job.said.append
    for name in ("save_checkpoint", "finish_checkpoint"):
        setattr(job, name, getattr(RLJob, name).__get__(job))
    return job


def test_a_background_save_commits_after_its_files_and_a_crash_before_keeps_the_previous_newest(tmp_path):
    """checkpoint.async_save: while the trainer writes step 4 in the background, step 2 stays the newest complete
    checkpoint and is not pruned (keep_last 1); a job that dies then resumes from step 2 and its next save clears
    the staging directory. Finished, step 4 is committed, and only then is step 2 pruned."""
    _save(tmp_path, 2, lineage="r1")
    job = _async_job(tmp_path)
    staging = job.save_checkpoint(4, 1.0, background=True)
    assert staging.name.startswith(".partial-") and not (staging / "trainer" / "metadata.json").exists()
    assert checkpoints.resume_path("auto", tmp_path, "r1").name == "step_2"
    # The job dies here: nothing renamed the staging directory, and the next job resumes from step 2.
    crashed = _async_job(tmp_path)
    assert checkpoints.resume_path("auto", tmp_path, "r1").name == "step_2"
    crashed.save_checkpoint(3, 1.0)  # synchronous
    assert not staging.exists()
    assert [p.name for _, p in run_layout.complete_checkpoints(tmp_path, "r1")] == ["step_3"]
    # The same save finished instead: committed, then the older one pruned.
    job = _async_job(tmp_path)
    job.save_checkpoint(5, 1.0, background=True)
    assert [p.name for _, p in run_layout.complete_checkpoints(tmp_path, "r1")] == ["step_3"]
    path = job.finish_checkpoint()
    assert path.name == "step_5" and (path / "trainer" / "metadata.json").is_file()
    assert [p.name for _, p in run_layout.complete_checkpoints(tmp_path, "r1")] == ["step_5"]
    assert job.finish_checkpoint() is None  # nothing pending


def test_a_save_while_one_is_written_commits_that_one_first(tmp_path):
    """Two background saves in a row: the first is finished and committed before the second's staging begins
    (`begin` deletes staging directories it finds), so neither is lost."""
    job = _async_job(tmp_path, keep_last=2)
    job.save_checkpoint(2, 1.0, background=True)
    job.save_checkpoint(4, 1.0, background=True)
    assert [call[0] for call in job.trainer.calls] == ["save_checkpoint", "finish_checkpoint", "save_checkpoint"]
    assert [p.name for _, p in run_layout.complete_checkpoints(tmp_path, "r1")] == ["step_2"]
    job.finish_checkpoint()
    assert [p.name for _, p in run_layout.complete_checkpoints(tmp_path, "r1")] == ["step_2", "step_4"]
