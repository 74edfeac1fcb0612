"""``mode.hf_checkpoint`` as bad input: one line naming the file and the problem, exit 2, nothing launched.

`HFCheckpoint.open` is checked on damaged copies of a tiny checkpoint (``hf_checkpoints``); three of the
cases also run as a user would (``python -m ftexp scenario=realistic_gsm8k ...``). A good checkpoint,
sharded or not, gives the Megatron model its config describes, and the policy's tokenizer is its own.
"""

import json
import shutil
from pathlib import Path

import pytest
from hf_checkpoints import EOS, token_id, write_checkpoint

from ftexp.config import Engine, ModeConfig
from ftexp.engines.megatron.hf_import import HFCheckpoint
from ftexp.errors import InputError
from ftexp.tasks.base import policy_tokenizer
from ftexp_runner import run_ftexp

GSM8K = Path(__file__).parents[2] / "tasks" / "fixtures" / "gsm8k_mini.jsonl"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("checkpoint") / "qwen3")


@pytest.fixture
def copy(checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "copy"))


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))


def test_a_good_checkpoint_is_the_model_its_config_describes(checkpoint):
    ckpt = HFCheckpoint.open(checkpoint)
    p = ckpt.preset
    assert (p.num_layers, p.hidden_size, p.num_attention_heads, p.num_query_groups, p.kv_channels, p.ffn_hidden_size,
            p.vocab_size, p.seq_length, p.num_experts) == (4, 48, 4, 2, 16, 80, 128, 1024, None)
    assert (p.rotary_base, p.layernorm_epsilon, ckpt.eos_token_id) == (1e6, 1e-6, token_id(EOS))
    tokenizer = policy_tokenizer(ModeConfig(name="m", num_cells=1, hf_checkpoint=str(checkpoint)))
    assert tokenizer.encode("7=") == [token_id("7"), token_id("=")] and tokenizer.end_id == token_id(EOS)
    assert tokenizer.decode(tokenizer.encode("Tom has 3 apples.")) == "Tom has 3 apples."


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path):
    from transformers import AutoModelForCausalLM

    single = write_checkpoint(tmp_path / "single")
    model = AutoModelForCausalLM.from_pretrained(str(single), local_files_only=True)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    shutil.copy(single / "tokenizer.json", tmp_path / "sharded")
    ckpt = HFCheckpoint.open(tmp_path / "sharded")
    assert len(set(ckpt.weight_files.values())) > 1 and ckpt.preset == HFCheckpoint.open(single).preset


def _damage(directory: Path, how: str) -> None:
    if how == "no config.json":
        (directory / "config.json").unlink()
    elif how == "not JSON":
        (directory / "config.json").write_text("{model_type: qwen3")
    elif how == "llama":
        _edit_config(directory, model_type="llama")
    elif how == "biases, GELU":
        _edit_config(directory, hidden_act="gelu", attention_bias=True)
    elif how == "scaled RoPE":
        _edit_config(directory, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    elif how == "no eos":
        _edit_config(directory, eos_token_id=None)
    elif how == "no weights":
        (directory / "model.safetensors").rename(directory / "pytorch_model.bin")
    elif how == "a weight missing":
        from safetensors.torch import load_file, save_file

        weights = load_file(str(directory / "model.safetensors"))
        del weights["model.layers.2.self_attn.k_proj.weight"]
        save_file(weights, str(directory / "model.safetensors"))
    elif how == "a shard missing":
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    elif how == "no tokenizer.json":
        (directory / "tokenizer.json").unlink()


DAMAGE = {  # how the checkpoint is damaged -> what the one line says (after "mode.hf_checkpoint: <path>")
    "no config.json": "config.json does not exist",
    "not JSON": "config.json is not readable JSON",
    "llama": "model_type 'llama' is not one the megatron engine builds (qwen3 or qwen3_moe)",
    "biases, GELU": "cannot express hidden_act=gelu, attention_bias=true",
    "scaled RoPE": "cannot express rope_type=yarn",
    "no eos": "has no eos_token_id",
    "no weights": "has no weights (model.safetensors or model.safetensors.index.json",
    "a weight missing": "1 weight(s) of the qwen3 model missing from the safetensors files, "
                        "e.g. model.layers.2.self_attn.k_proj.weight",
    "a shard missing": "model-00002-of-00002.safetensors does not exist",
    "no tokenizer.json": "tokenizer.json does not exist",
}


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_checkpoint_is_one_line_naming_the_problem(copy, how):
    _damage(copy, how)
    with pytest.raises(InputError) as raised:
        HFCheckpoint.open(copy)
    message = str(raised.value)
    assert message.startswith(f"mode.hf_checkpoint: {copy}") and DAMAGE[how] in message and "\n" not in message


def test_a_missing_directory_is_named(tmp_path):
    with pytest.raises(InputError, match=f"^mode.hf_checkpoint: {tmp_path / 'nowhere'} does not exist$"):
        HFCheckpoint.open(tmp_path / "nowhere")


def test_the_torch_engine_refuses_a_checkpoint(checkpoint):
    from ftexp.engines.registry import get_engine

    mode = ModeConfig(name="dp2", num_cells=2, hf_checkpoint=str(checkpoint))
    with pytest.raises(InputError, match="needs trainer=megatron"):
        get_engine(Engine.torch).validate(mode, None)


@pytest.mark.parametrize("how", ["missing path", "no config.json", "llama"])
def test_bad_checkpoint_exits_2_with_one_line(copy, tmp_path, how):
    path = tmp_path / "nowhere" if how == "missing path" else copy
    if how != "missing path":
        _damage(copy, how)
    result = run_ftexp("scenario=realistic_gsm8k", f"task.data_path={GSM8K}", f"mode.hf_checkpoint={path}",
                       "scenario.metric_threshold=0.5", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"ftexp: error: mode.hf_checkpoint: {path}"), result.stderr
    assert (DAMAGE[how] if how in DAMAGE else "does not exist") in lines[0]
    assert not (tmp_path / "run" / "target").exists()  # nothing launched
