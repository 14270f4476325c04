"""benchmarks/gpu_check.py, prepared for a lent GPU: its CPU dry-run runs every part at a tiny shape, and the
models it builds on the device directly (meta, then drawn there) are the models their configs describe."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import device_models  # noqa: E402
import gpu_check  # noqa: E402

from hf_rebasin.sources.models import instantiate  # noqa: E402


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return device_models.template_for("tiny", tmp_path_factory.mktemp("config") / "tiny")


def test_template_builds_on_the_meta_device(template):
    """What build_on_device starts from: parameters without memory, buffers real."""
    model = template.backend.build(template, {})
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert all(b.device.type == "cpu" for b in model.buffers())


def test_model_built_on_the_device_is_complete_and_initialised(template):
    model = device_models.build_on_device(template, 1, "cpu")
    params = dict(model.named_parameters())
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params.values())
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert sum(p.numel() for p in params.values()) == device_models.parameter_count("tiny")
    # the rotary frequencies (a buffer, not drawn) are those of a model built the ordinary way
    from transformers import GPTNeoXForCausalLM
    ordinary = dict(GPTNeoXForCausalLM(template.config).named_buffers())
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(buffer, ordinary[name])
    # initialisation: matrices N(0, 0.02), norm gains N(1, 0.1), biases N(0, 0.01)
    qkv = params["gpt_neox.layers.0.attention.query_key_value.weight"]
    gain = torch.cat([p for n, p in params.items() if p.ndim == 1 and n.endswith("norm.weight")])
    bias = torch.cat([p for n, p in params.items() if n.endswith(".bias")])
    assert abs(float(qkv.std()) - 0.02) < 0.002 and abs(float(qkv.mean())) < 0.002
    assert abs(float(gain.mean()) - 1.0) < 0.02 and abs(float(gain.std()) - 0.1) < 0.02
    assert abs(float(bias.std()) - 0.01) < 0.002


def test_model_built_on_the_device_is_deterministic_per_seed(template):
    a, again, b = (dict(device_models.build_on_device(template, s, "cpu").named_parameters()) for s in (1, 1, 2))
    assert all(torch.equal(a[n], again[n]) for n in a)
    assert not torch.equal(a["gpt_neox.embed_in.weight"], b["gpt_neox.embed_in.weight"])


def test_canonical_graph_of_a_device_built_model_is_that_model(template):
    model = device_models.build_on_device(template, 3, "cpu")
    graph = device_models.canonical_graph(model, template)
    assert all(v.device.type == "cpu" for v in graph.params.values())
    x = torch.randint(0, template.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(instantiate(graph, template)(input_ids=x).logits, model(input_ids=x).logits,
                                   rtol=1e-5, atol=1e-5)


def test_tables_show_the_memory_plan_and_failures(capsys):
    """The report with a recorded memory plan (h42's barrier.json section), without one, and with failed parts."""
    gib = 2**30
    plan = {"estimated_peak_bytes": 20 * gib, "free_bytes": 79 * gib, "micro_batch": 16, "accumulation": 4,
            "gradient_checkpointing": True, "sampling_peak_bytes": 3 * gib}
    run = {"batch": 64, "seq": 512, "step_s": 2.0, "tokens_per_s": 16384.0, "s_per_1000_steps": 2000.0,
           "hours": {"20000": 11.1, "50000": 27.8}, "peak_bytes": 18 * gib, "default_steps": 300}
    rows = [{"config": "pythia-1b", "defaults": {**run, "memory_plan": plan}, "papers": {**run, "memory_plan": None},
             "plain": {"step_s": 0.5}, "sampling": {"tokens_per_s": 1000.0, "peak_bytes": 2 * gib, "dtype": "bfloat16"},
             "self_tokens_at_defaults": 1_000_000},
            {"config": "pythia-160m", "defaults": {"error": "OutOfMemoryError: CUDA out of memory"},
             "papers": {**run, "memory_plan": None}, "plain": {"error": "RuntimeError: x"},
             "sampling": {"error": "AttributeError: no cache"}, "self_tokens_at_defaults": 1}]
    agreed = {"runs": {"cuda bf16": {"barrier": 0.5, "seconds": 1}, "cpu fp32": {"barrier": 0.52, "seconds": 2}},
              "difference": 0.02, "tolerance": gpu_check.AGREE_NATS, "agree": False, "settings": "s"}
    gpu_check.print_tables(rows, agreed, [20000, 50000], "a GPU")
    out = capsys.readouterr().out
    assert "| pythia-1b | defaults | 64 x 512 | 16 x 4, checkpointing | 2.000 | 16,384 | 2,000 | 11.1 | 27.8 | " \
           "18.00 | 20.00 | 79.00 |" in out
    assert "| pythia-1b | papers | 64 x 512 | n/a |" in out
    assert "| pythia-1b | 0.500 | 4.00 | 1,000 (bfloat16) | 2.00 | 3.00 | 1,000 / 600 |" in out
    assert "| pythia-160m | defaults | FAILED: OutOfMemoryError: CUDA out of memory |" in out
    assert "FAILED: AttributeError: no cache" in out and "DISAGREE" in out
    assert gpu_check.failures(rows, agreed) == ["pythia-160m plain", "pythia-160m sampling", "pythia-160m defaults",
                                                "agreement"]


def test_dry_run_runs_every_part_on_the_cpu(tmp_path, capsys):
    """The command a GPU machine runs, on the CPU at a tiny config: model building, the plain step, `self` sampling,
    learned matching at the defaults and at the papers' setting, and the example pair's agreement check."""
    out_json = tmp_path / "gpu_check.json"
    status = gpu_check.main(["--dry-run", "--json", str(out_json)])
    printed = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert status == 0, printed
    (row,) = result["rows"]
    assert row["config"] == "pythia-tiny" and row["params"] == device_models.parameter_count("tiny")
    assert row["plain"]["step_s"] > 0 and row["sampling"]["tokens_per_s"] > 0
    assert row["sampling"]["dtype"] == "bfloat16"
    defaults, papers = row["defaults"], row["papers"]
    assert (defaults["batch"], defaults["soft_targets"]) == (64, 1.0)  # the package's defaults
    assert (papers["batch"], papers["soft_targets"], papers["precision"]) == (4, 0.0, "bf16")
    for run in (defaults, papers):
        assert run["step_s"] > 0 and run["hours"]["50000"] == pytest.approx(50000 * run["step_s"] / 3600)
        assert run["memory_plan"] is None or set(run["memory_plan"]) == set(gpu_check.PLAN_KEYS)
    agreed = result["agreement"]
    assert agreed["agree"] and set(agreed["runs"]) == {"cpu bf16", "cpu fp32"}
    assert "| pythia-tiny | defaults | 64 x 16 |" in printed and "-> AGREE" in printed


def test_quick_and_dry_run_settings():
    quick = gpu_check.parse_args(["--quick"])
    assert (quick.configs, quick.steps) == ("160m", 6)
    dry = gpu_check.parse_args(["--dry-run"])
    assert (dry.device, dry.configs) == ("cpu", "tiny")
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--steps", "2"])


def test_learned_runs_take_the_memory_plan_of_a_merge(template):
    """gpu_check calls learn() directly: it makes the plan `merge` makes (here under --max-memory, on the CPU) and
    runs with its accumulation and checkpointing; on the CPU without --max-memory nothing is planned, as in merge."""
    from hf_rebasin.match.memory_plan import HEADROOM, estimate_peak, step_shape
    from hf_rebasin.options import MergeOptions
    graphs = [device_models.canonical_graph(device_models.build_on_device(template, seed, "cpu"), template)
              for seed in (1, 2)]
    options = MergeOptions(method="dual", device="cpu", learn_batch_size=64)
    assert gpu_check.planned(options, graphs, 64) == (options, None)
    shape = step_shape(graphs[0].spec, {k: tuple(v.shape) for k, v in graphs[0].params.items()}, 2, "dual")
    whole, eighth = (estimate_peak(shape, micro_batch=m, seq_len=64, checkpointing=False, value_bytes=4,
                                   soft_targets=True) for m in (64, 8))
    budget = int((whole + eighth) / 2 / HEADROOM)  # the whole batch does not fit, an eighth of it does
    tight = MergeOptions(method="dual", device="cpu", learn_batch_size=64, max_memory=str(budget))
    chosen, plan = gpu_check.planned(tight, graphs, 64)
    assert plan["planned"] and plan["micro_batch"] * plan["accumulation"] == 64 and plan["accumulation"] > 1
    assert (chosen.grad_accum, chosen.gradient_checkpointing) == (plan["accumulation"], plan["gradient_checkpointing"])
    assert plan["estimated_peak_bytes"] <= HEADROOM * budget
