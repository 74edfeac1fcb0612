"""Tasks: the ASCII encoding, disjoint splits, exact grading, the GSM8K reader and the task's validation."""

import json
from pathlib import Path

import pytest
import torch

from ftexp.config import TaskConfig, TaskName
from ftexp.errors import InputError
from ftexp.rollout.tokenizer import build_ascii_tokenizer
from ftexp.tasks import build_task
from ftexp.tasks.base import ASCII, END, END_ID, Problem, decode, encode, response_text
from ftexp.tasks.gsm import final_number, grade, read_gsm8k
from ftexp.tasks.warmup import supervised_batch
from ftexp_runner import run_ftexp

FIXTURES = Path(__file__).parent / "fixtures"
DATA, TEST = FIXTURES / "gsm8k_mini.jsonl", FIXTURES / "gsm8k_test_mini.jsonl"


def test_encoding_is_the_rollout_tokenizers():
    text = "4-1+7=10\nQuestion: $1,250?" + END
    assert encode(text) == build_ascii_tokenizer().encode(text).ids
    assert decode(encode(text)) == text
    assert encode("é") == build_ascii_tokenizer().encode("é").ids == [0x1A]  # outside ASCII: SUB
    assert END_ID == ASCII.end_id == 4 and response_text(encode("-12" + END + "junk"), ASCII) == "-12"


@pytest.fixture(scope="module")
def arith():
    return build_task(TaskConfig(name=TaskName.arith, eval_size=200))


def test_arith_splits_are_disjoint_and_seeded(arith):
    eval_prompts = {p.prompt for p in arith.eval_problems()}
    train = {p.prompt for r in range(20) for p in arith.train_problems(r, 32, seed=1)}
    warmup = {p.prompt for s in range(20) for p in arith.warmup_problems(s, 64, seed=1)}
    assert len(eval_prompts) == 200 and len(train) > 300 and len(warmup) > 500
    assert not eval_prompts & train and not eval_prompts & warmup and not train & warmup
    # A pure function of (seed, rollout id); the eval set does not depend on the experiment seed at all.
    assert arith.train_problems(3, 8, seed=1) == arith.train_problems(3, 8, seed=1)
    assert arith.train_problems(3, 8, seed=1) != arith.train_problems(4, 8, seed=1)
    assert arith.train_problems(3, 8, seed=1) != arith.train_problems(3, 8, seed=2)
    other_run = build_task(TaskConfig(name=TaskName.arith, eval_size=200))
    assert other_run.eval_problems() == arith.eval_problems()
    assert build_task(TaskConfig(name=TaskName.arith, dataset_seed=1)).eval_problems() != arith.eval_problems()


def test_arith_problems_are_chain_sums_graded_exactly(arith):
    for p in arith.eval_problems()[:50]:
        assert p.prompt.endswith("=") and p.answer == p.solution == str(eval(p.prompt[:-1]))
    problem = Problem(prompt="0-4-8=", answer="-12", solution="-12")
    assert arith.reward(problem, "-12") == 1.0
    assert arith.reward(problem, " -12 ") == 1.0
    # reasoning-gym gives partial credit to an answer containing the right one: that is no answer here
    for wrong in ("12", "-120", "-12-12", "-1", "", "x", "-12=0"):
        assert arith.reward(problem, wrong) == 0.0, wrong


@pytest.mark.parametrize("text, number", [
    ("She has 27 - 20 = 7 left.\n#### 7", "7"),
    ("#### 1,550", "1550"),
    ("So the answer is 18.", "18"),
    ("It costs $2.50 each, 4 of them: $10.", "10"),
    ("#### -5 degrees, not 4", "-5"),
    ("12 then #### 3 then #### 4", "4"),
    ("no number here", None),
])
def test_final_number(text, number):
    assert final_number(text) == number


def test_gsm8k_reader_and_grading():
    problems = read_gsm8k(DATA)
    assert len(problems) == 12
    assert [p.answer for p in problems[:6]] == ["7", "150", "8", "875", "-5", "2.5"]
    for p in problems:  # every reference solution grades right, and with the answer changed, wrong
        assert p.prompt.startswith("Question: ") and grade(p.solution, p.answer) == 1.0
        assert grade(p.solution.rsplit("####", 1)[0] + f"#### {float(p.answer) + 1}", p.answer) == 0.0
    assert grade("#### 875.0", "875") == 1.0 and grade("#### 875", "875.5") == 0.0

    task = build_task(TaskConfig(name=TaskName.gsm8k, data_path=str(DATA), eval_path=str(TEST)))
    assert [p.answer for p in task.eval_problems()] == ["23", "66", "1550"]
    train = {p.prompt for r in range(10) for p in task.train_problems(r, 4, seed=1)}
    warmup = {p.prompt for s in range(10) for p in task.warmup_problems(s, 4, seed=1)}
    assert train and warmup and not train & warmup
    assert not (train | warmup) & {p.prompt for p in task.eval_problems()}
    assert task.metric_key == "eval/gsm8k"


def test_gsm8k_bad_files_are_one_line_input_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        read_gsm8k(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(InputError, match="record 1 needs a question and an answer ending in '#### <number>'"):
        read_gsm8k(bad)
    bad.write_text('{"question": "q", "answer": "#### 3"}\nnot json\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: not a JSON line"):
        read_gsm8k(bad)
    with pytest.raises(InputError, match="is not a file"):
        read_gsm8k(FIXTURES)
    (tmp_path / "gsm8k.csv").write_text("question,answer\n")
    with pytest.raises(InputError, match="must be a .jsonl or .parquet"):
        read_gsm8k(tmp_path / "gsm8k.csv")


def test_gsm_symbolic_generates_gradable_word_problems():
    task = build_task(TaskConfig(name=TaskName.gsm_symbolic, eval_size=5))
    for p in task.eval_problems():
        assert "####" in p.solution and task.reward(p, p.solution) == 1.0
        assert task.reward(p, "#### 0.123") == 0.0


def test_warmup_batch_masks_the_answer_and_end_only():
    problems = [Problem("1+2=", "3", "3"), Problem("9-9-9=", "-9", "-9")]
    batch = supervised_batch(problems, ASCII)
    assert batch.tokens.tolist()[0][:6] == encode("1+2=3" + END)
    for row, p in enumerate(problems):
        targets = batch.tokens[row, 1:][batch.loss_mask[row] == 1]
        assert decode(targets.tolist()) == p.solution + END
    assert torch.equal(batch.advantages, torch.ones(2))


def test_missing_gsm8k_path_exits_2_with_one_line(tmp_path):
    result = run_ftexp("scenario=realistic", "task=gsm8k", f"task.data_path={tmp_path / 'gsm8k.jsonl'}",
                       f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("ftexp: error:")]
    assert lines == [f"ftexp: error: task.data_path: GSM8K file {tmp_path / 'gsm8k.jsonl'} does not exist"]
    assert not (tmp_path / "run" / "target").exists()  # nothing launched


@pytest.mark.parametrize("overrides, message", [
    (["task=arith"], "a task needs an accuracy scenario"),
    (["scenario=realistic", "mode=dp2"], "mode dp2 has no rollout engines"),
    (["scenario=realistic", "task=none"], "it needs a task"),
    (["scenario=realistic", "task=gsm_symbolic"], "exceed the 64-token context"),
    (["scenario=realistic", "scenario.metric_threshold=1.5"], "metric_threshold must be an accuracy in (0, 1]"),
    (["scenario=realistic_gsm8k"], "task=gsm8k needs task.data_path=<a GSM8K .jsonl or .parquet file>"),
    (["scenario=realistic", "scenario.metric_threshold=null"], "set scenario.metric_threshold"),
    (["scenario=realistic_gsm8k", f"task.data_path={DATA}"], "task=gsm8k trains a policy loaded from an HF checkpoint: "
                                                             "set mode.hf_checkpoint=<"),
])
def test_task_settings_are_validated(tmp_path, overrides, message):
    from hydra import compose, initialize_config_module

    from ftexp.cli import CONFIG_MODULE, to_config
    from ftexp.cli import register_configs

    register_configs()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        to_config(cfg)
