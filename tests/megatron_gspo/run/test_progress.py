"""Progress lines: step time and tokens/s since the last line, the ETA from the mean step time
since this start (`megatron_gspo.run.progress`), and what each job prints through the CLI."""

import json

from megatron_gspo import cli
from megatron_gspo.run.progress import ChunkProgress, Pace, format_duration


def clock(*readings):
    values = iter(readings)
    return lambda: float(next(values))


def test_durations_read_as_hours_minutes_seconds():
    assert [format_duration(s) for s in (0, 59.6, 369, 27 * 3600, -4)] == \
        ["0:00:00", "0:01:00", "0:06:09", "27:00:00", "0:00:00"]


def test_step_time_and_tokens_since_the_last_line_and_the_eta_from_the_mean():
    """Steps 1-2 took 10 s, steps 3-6 took 10 s: the second line's step time is the recent one
    (2.5 s), its ETA the mean since the start (20 s / 6 steps) times the 4 steps left."""
    pace = Pace(total=10, clock=clock(0, 10, 20))
    assert pace.summary(2, tokens=500) == "5.00 s/step, 50 tokens/s, ETA 0:00:40"
    assert pace.summary(6, tokens=4000) == "2.50 s/step, 400 tokens/s, ETA 0:00:13"


def test_a_resumed_run_measures_from_its_resume_and_a_job_without_tokens_omits_them():
    pace = Pace(total=100, done=90, unit="rollout batch", clock=clock(50, 80))
    assert pace.summary(93, tokens=0) == "10.00 s/rollout batch, ETA 0:01:10"


def test_an_eval_prints_a_line_per_batch_on_stderr(capsys):
    progress = ChunkProgress("eval", is_main=True, dp=2, clock=clock(0, 4, 6))
    progress(0, 2, 0)
    progress(1, 2, 100)
    progress(2, 2, 100)
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == ["[eval 1/2] 4.00 s/batch, 50 tokens/s, ETA 0:00:04",
                                "[eval 2/2] 2.00 s/batch, 100 tokens/s, ETA 0:00:00"]
    quiet = ChunkProgress("eval", is_main=False, dp=1)
    quiet(0, 1, 0)
    quiet(1, 1, 5)
    assert capsys.readouterr() == ("", "")


TINY = ["model.preset=tiny", "task.kwargs.num_digits=1", "task.n_train=20", "task.n_test=6",
        "task.n_val=4", "rollout.max_new_tokens=3", "wandb.mode=disabled"]


def test_sft_train_and_eval_print_step_time_tokens_per_second_and_an_eta(tmp_path, capsys):
    """Through the CLI: sft and train print their progress lines with the pace on stdout;
    eval prints one line per batch of each split on stderr, its JSON result alone on stdout."""
    run = f"run_dir={tmp_path / 'sft'}"
    assert cli.main(["sft", *TINY, run, "sft.steps=2", "sft.eval_every=1", "sft.batch_size=4"]) \
        == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[")]
    assert [x.split("]")[0] for x in lines] == ["[  1/2", "[  2/2"]
    assert all(" s/step, " in x and " tokens/s, ETA " in x for x in lines), lines
    assert cli.main(["train", *TINY, f"run_dir={tmp_path / 'rl'}", "train.steps=1",
                     "rollout.prompts_per_batch=2", "rollout.group_size=2"]) == 0
    line, = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[")]
    assert line.startswith("[  1/1] reward/mean=") and " s/rollout batch, " not in line
    assert " s/step, " in line and " tokens/s, ETA 0:00:00" in line
    assert cli.main(["eval", *TINY, f"init_checkpoint={tmp_path / 'sft'}", run]) == 0
    out, err = capsys.readouterr()
    assert set(json.loads(out)) >= {"eval/accuracy", "test/accuracy", "test/reward"}
    labels = [x.split(" ")[0] for x in err.splitlines() if x.startswith("[")]
    assert labels == ["[eval", "[test", "[test/reward"], err
