"""``bench/gpu.py``, the GPU check that a session with a CUDA card runs: its pure pieces in the default run
(the FLOPs formula against hand-computed numbers, the peak table, the flags refused in one line, the
tables and JSON made from workers' results), and the whole script's CPU smoke run (slow).
"""

import importlib.util
import json
import math
import subprocess
import sys

import pytest

from flax_transformer.models.llama_config import LlamaConfig
from parity_tests.project.docs_blocks import ROOT

BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def gpu():
    sys.path.insert(0, str(BENCH))  # gpu.py imports its siblings (benchlib, speed_isolated) by name
    try:
        spec = importlib.util.spec_from_file_location("gpu", BENCH / "gpu.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def test_flops_per_token_by_hand(gpu):
    # 1 layer, D 4, 2 query heads and 1 key/value head of width 2, gated MLP 8, vocab 10, T 3:
    # q, o 4*2*2 each = 16 + 16; k, v 4*1*2 each = 8 + 8; MLP 3*4*8 = 96; head 4*10 = 40 -> N = 184
    shape = dict(layers=1, hidden=4, heads=2, kv_heads=1, head_dim=2, inner=8, vocab=10, mlp_matrices=3)
    assert gpu.flops_per_token(shape, 3) == dict(matmul_weights=184, weights_term=6 * 184,
                                                 attention_term=12 * 1 * 3 * 2 * 2, total=6 * 184 + 144)
    # GPT-2 small (124M with its 1024 x 768 position table and norms, not matmuls) and Llama-3.2-1B
    # (1,235,814,400 parameters less its 33 norms of 2048)
    small = gpu.flops_per_token(gpu.SHAPES["gpt2-small"], 1024)
    assert small["matmul_weights"] == 123_532_032 and small["attention_term"] == 113_246_208
    big = gpu.flops_per_token(gpu.SHAPES["llama-1b"], 2048)
    assert big["matmul_weights"] == 1_235_814_400 - 33 * 2048 and big["attention_term"] == 805_306_368


def test_llama_1b_shape_is_llama_3_2_1b(gpu):
    assert gpu.llama_config("llama-1b") == LlamaConfig.llama3_1b()
    assert gpu.llama_config("llama-1b", layers=4) == LlamaConfig.llama3_1b(num_hidden_layers=4)


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H200", 989.4), ("NVIDIA H200 NVL", 835.5), ("NVIDIA GH200 480GB", 989.4),
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA L40S", 362.1), ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0), ("NVIDIA A10", 125.0),
    ("Tesla V100-SXM2-16GB", None), ("cpu", None)])
def test_peak_table_by_device_name(gpu, name, tflops):
    assert gpu.peak_tflops(name) == tflops


@pytest.mark.parametrize("argv, said", [
    (["--rounds", "0"], "--rounds: must be positive"), (["--steps", "-1"], "--steps: must be positive"),
    (["--only", "everything"], "--only: invalid choice"), (["--device", "tpu"], "--device: invalid choice"),
    (["--json", "no/such/folder/out.json"], "the parent folder no/such/folder does not exist")])
def test_bad_flags_refused_in_one_line(gpu, argv, said, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu.parse(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("gpu.py: error: ") and said in err, err


def test_bad_flag_exits_2_before_any_work():
    proc = subprocess.run([sys.executable, str(BENCH / "gpu.py"), "--budget", "0"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr


def _train(contender, round_, seconds, device_name):
    return dict(section="train", model="llama-tiny", contender=contender, round=round_, times=seconds, batch=2, seq=32,
                shape=dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, inner=128, vocab=512, mlp_matrices=3),
                attention="xla", first_loss=6.2, first_call_s=1.0, peak_flops=1e12, device_name=device_name)


@pytest.mark.parametrize("device_name", ["cpu", "NVIDIA H200"])
def test_summary_and_report_from_worker_results(gpu, device_name):
    results = [_train(c, r, [t * (1 + r), t * (1 + r)], device_name)
               for r in range(2) for c, t in ((gpu.JAX, 0.01), (gpu.EAGER, 0.02), (gpu.COMPILE, 0.04))]
    results += [dict(section="decode", model="llama-tiny", contender=c, round=0, times=[0.5], tokens=tokens, batch=1,
                     prompt=8, new=4, cache=c + "'s cache", device_name=device_name)
                for c, tokens in ((gpu.JAX, [[1, 2, 3, 4]]), ("transformers", [[1, 2, 9, 9]]))]
    results.append(dict(section="train", model="gpt2-tiny", contender=gpu.COMPILE, round=0, failed="exited 1: boom"))
    found = dict(what="llama-tiny", first_divergent="model.norm", budget_line="model output: ...", torch_imported=False)
    results += [dict(section="bisect", contender="record (CPU)", trace_bytes=4096, wall_s=3.0),
                dict(section="bisect", contender="bisect (cpu)", report=found, wall_s=2.0)]
    out = dict(device="cpu", smoke=device_name == "cpu", results=results)
    summary = gpu.summarize(out)
    rows = {row["contender"]: row for row in summary["train"]}
    flops = 6 * (2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128) + 64 * 512) + 12 * 2 * 32 * 4 * 16
    assert rows[gpu.JAX]["flops_per_token"] == flops
    assert rows[gpu.JAX]["tokens_per_s"] == pytest.approx(64 / 0.015)  # median of 0.01, 0.01, 0.02, 0.02
    # per round: eager's time over JAX's is 2 in both rounds, compile's 4
    assert rows[gpu.EAGER]["time_over_jax"]["median"] == pytest.approx(2.0)
    assert rows[gpu.COMPILE]["time_over_jax"]["median"] == pytest.approx(4.0)
    if device_name == "cpu":
        assert all(row["mfu"] is None for row in summary["train"]) and "unknown peak" in summary["peak_note"]
    else:
        assert rows[gpu.JAX]["mfu"] == pytest.approx(64 / 0.015 * flops / 989.4e12)
    decode = {row["contender"]: row for row in summary["decode"]}
    assert decode["transformers"]["tokens_equal_to_jax"] == 0.5 and decode[gpu.JAX]["new_tokens_per_s"] == 8
    assert summary["bisect"] == dict(found, record_s=3.0, trace_bytes=4096, bisect_s=2.0)
    assert summary["failed"] == ["train gpt2-tiny torch.compile round 1: exited 1: boom"]
    text = gpu.report(out, summary)
    assert ("unknown peak" in text) == (device_name == "cpu")
    assert "trace bisect (llama-tiny): first divergent module: model.norm; model output: ...;" in text
    assert "NOT MEASURED: train gpt2-tiny torch.compile round 1: exited 1: boom" in text
    assert text.startswith(f"NOTE: {gpu.SMOKE_NOTE}") == (device_name == "cpu")


def _numbers(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


@pytest.mark.slow(reason="test_summary_and_report_from_worker_results and test_bad_flags_refused_in_one_line: "
                         "the smoke run starts ten processes (minutes on 2 cores)")
def test_cpu_smoke_run(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(BENCH / "gpu.py"), "--device", "cpu", "--rounds", "1", "--steps", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CPU smoke figures, not GPU ones" in proc.stdout
    data = json.loads(out.read_text())
    assert data["smoke"] and data["failed"] == []
    assert {(r["model"], r["contender"]) for r in data["train"]} == {
        (m, c) for m in ("gpt2-tiny", "llama-tiny") for c in ("jax", "torch eager", "torch.compile")}
    assert {r["contender"] for r in data["decode"]} == {"jax", "transformers"}
    for row in data["train"] + data["decode"]:
        assert all(math.isfinite(x) for x in _numbers(row)), row
        assert row.get("tokens_per_s", row.get("new_tokens_per_s")) > 0
    bisect = data["bisect"]  # a correct bf16 port: no module beyond its budget, torch not imported
    assert bisect["passed"] and bisect["first_divergent"] is None and not bisect["torch_imported"], bisect
    assert 0 < bisect["model_jax_err"] < bisect["model_budget"] < math.inf, bisect
