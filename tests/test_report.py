"""`slimish report`: the figures a run's metrics can fill, the files it writes, and its one-line errors. (The page
of a real run, rendered in a real browser: tests/e2e/test_rl_loop.py.)"""

from __future__ import annotations

import json

from slimish.cli import main
from slimish.reporting.figures import draw


def record(step: int, **extra) -> dict:
    return {"step": step, "reward_mean": 0.1 * step, "response_len_mean": 5.0, "time_rollout_s": 1.0,
            "time_train_s": 0.5, "time_sync_s": 0.2, "time_verify_s": 0.05, "tokens_per_s": 100.0, "sync_mib": 1.0,
            "engine_deaths": 0, "engine_hangs": 0, "engine_restarts": 0, **extra}


def test_figures_follow_the_metrics_the_run_recorded():
    stems = [stem for stem, _, _ in draw([record(1), record(2)])]
    assert stems == ["reward", "timeline", "throughput", "sync", "engines"]
    with_more = draw([record(1, staleness_max=1, off_policy_token_frac=0.1, lr=1e-6, grad_norm=0.5,
                            **{"eval/pass@4": 0.5})])
    assert [stem for stem, _, _ in with_more] == ["reward", "timeline", "throughput", "off_policy", "sync", "engines",
                                                  "lr", "eval"]


def test_report_writes_a_self_contained_page_and_pngs(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(record(s)) + "\n" for s in (1, 2, 3)))
    assert main(["report", str(run)]) == 0
    page = (run / "report" / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 5 and "http" not in page.replace("http-equiv", "")
    assert sorted(p.name for p in (run / "report").glob("*.png")) == [
        "engines.png", "reward.png", "sync.png", "throughput.png", "timeline.png"]


def test_a_directory_without_metrics_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no metrics.jsonl" in err and err.count("\n") == 1


def test_a_cut_last_line_is_left_out_and_a_bad_line_is_named(tmp_path, capsys):
    """A live or killed run's last line may be half written: the report is drawn from the whole lines. Any other line
    it cannot read is one line naming the file and the line (on main at a706c6e: a JSONDecodeError naming neither)."""
    run = tmp_path / "run"
    run.mkdir()
    whole = "".join(json.dumps(record(s)) + "\n" for s in (1, 2))
    (run / "metrics.jsonl").write_text(whole + '{"step": 3, "reward_me')
    assert main(["report", str(run)]) == 0
    (run / "metrics.jsonl").write_text(whole + "{oops\n" + json.dumps(record(3)) + "\n")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert f"{run / 'metrics.jsonl'}:3: cannot read this line" in err
