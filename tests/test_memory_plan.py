"""The memory plan of learned matching (match/memory_plan.py): its estimate against a count of the real step on fake
tensors (match/memory_count.py) at the published Pythia configs, the plan for a pretended GPU of 24, 40 and 80 GB
(the effective batch unchanged, the plan under the memory), the one-line error when nothing fits, and the plan
recorded in barrier.json by a run.  The counts at 1B and 6.9B take minutes on this CPU: they run with
HF_REBASIN_SLOW_COUNTS=1 (benchmarks/memory_plan_check.py prints the same table)."""
from __future__ import annotations

import contextlib
import json
import os
from unittest import mock

import pytest
import torch
from conftest import short_dual

from hf_rebasin.match.memory_count import LiveBytes, config_template, count_step, fake_tensors, meta_graph
from hf_rebasin.match.memory_plan import (
    HEADROOM,
    MemoryPlanError,
    estimate_peak,
    plan_run,
    step_shape,
)
from hf_rebasin.options import MergeOptions

# the published configs (EleutherAI/pythia-*/config.json): hidden, layers, heads, FFN, vocabulary
PYTHIA = {"160m": (768, 12, 12, 3072, 50304), "1b": (2048, 16, 8, 8192, 50304), "6.9b": (4096, 32, 32, 16384, 50432)}
SLOW = os.environ.get("HF_REBASIN_SLOW_COUNTS") == "1"
GB = 10**9


def pythia(name: str):
    from transformers import GPTNeoXConfig
    hidden, layers, heads, ffn, vocab = PYTHIA[name]
    return config_template(GPTNeoXConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                         intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=2048,
                                         rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False,
                                         architectures=["GPTNeoXForCausalLM"]))


def shape_of(template, n_models: int = 2, method: str = "dual"):
    graph = meta_graph(template)
    return step_shape(graph.spec, {k: tuple(v.shape) for k, v in graph.params.items()}, n_models, method)


# One case of each published size always; the rest (minutes) only under HF_REBASIN_SLOW_COUNTS=1 (not skipped:
# CI treats a skip as a failure).
CASES = [("160m", 64, False), ("1b", 64, False), ("6.9b", 16, True)] + (
    [("160m", 64, True), ("1b", 16, False), ("1b", 16, True), ("6.9b", 16, False)] if SLOW else [])


@pytest.mark.parametrize(("name", "batch", "checkpointing"), CASES)
def test_the_estimate_is_within_15_percent_of_the_count(name, batch, checkpointing):
    """dual at the defaults (windows of 512 tokens, soft targets, bf16), whole or checkpointed."""
    template = pythia(name)
    count = count_step(template, batch=batch, seq=512, checkpointing=checkpointing, soft_targets=1.0)
    shape = shape_of(template)
    assert shape.learned_parameters == count.learned_parameters and shape.model_parameters == count.model_parameters
    estimate = estimate_peak(shape, micro_batch=batch, seq_len=512, checkpointing=checkpointing, value_bytes=2,
                             soft_targets=True)
    assert abs(estimate / count.peak_bytes - 1) < 0.15, (estimate / 2**30, count.peak_bytes / 2**30)


def test_the_count_sees_what_the_step_frees():
    """The counter's peak grows with the batch, and the soft target adds exactly its fp32 (batch, tokens, vocabulary)
    tensor (a counter that missed allocations or frees would not show both)."""
    from transformers import GPTNeoXConfig
    template = config_template(GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=256, vocab_size=50304, rotary_pct=0.25,
                                             architectures=["GPTNeoXForCausalLM"]))
    small, large = (count_step(template, batch=b, seq=128, soft_targets=0.0) for b in (2, 8))
    soft = count_step(template, batch=8, seq=128, soft_targets=1.0)
    assert large.step_peak_bytes > small.step_peak_bytes
    assert soft.step_peak_bytes - large.step_peak_bytes == pytest.approx(8 * 127 * 50304 * 4, rel=0.01)  # the target


def test_a_view_of_a_tensor_made_before_the_count_allocates_nothing():
    """The frozen endpoints exist before the step (held bytes): their views and in-place updates inside it (a teacher
    pass reads them as they are) are not the step's allocations; a new tensor is."""
    with fake_tensors():
        held = torch.empty(256, 64)
        with LiveBytes() as live:
            held.T.reshape(64, 256)[:4].unflatten(0, (2, 2))
            held.view(64, 256).add_(1.0)
            assert live.peak == 0
            held.T.contiguous()
            assert live.peak == 256 * 64 * 4


@pytest.fixture(scope="module")
def one_b():
    return pythia("1b")


def fake_gpu(free: int):
    """torch.cuda as a GPU with `free` bytes free would answer (no GPU needed)."""
    return [mock.patch("torch.cuda.mem_get_info", return_value=(free, 80 * GB)),
            mock.patch("torch.cuda.is_bf16_supported", return_value=True),
            mock.patch("torch.cuda.device", side_effect=lambda device: contextlib.nullcontext())]  # cuda:N chosen


def planned(template, free: int, **options):
    patches = fake_gpu(free)
    for patch in patches:
        patch.start()
    try:
        return plan_run(MergeOptions(method="dual", device="cuda", **options), template, 2, progress=False)
    finally:
        for patch in patches:
            patch.stop()


@pytest.mark.parametrize("gigabytes", [24, 40, 80])
def test_the_plan_fits_the_card_and_keeps_the_batch(one_b, gigabytes):
    """Pythia-1B dual at the defaults (64 windows a step, 512 tokens, soft targets: ~76 GB whole) on a pretended GPU."""
    options, plan = planned(one_b, gigabytes * GB, soft_targets=1.0)
    assert plan["planned"] and plan["free_from"] == "torch.cuda.mem_get_info" and plan["precision"] == "bf16"
    assert plan["micro_batch"] * plan["accumulation"] == 64 == plan["effective_batch"] == options.learn_batch_size
    assert plan["accumulation"] > 1  # the whole batch would not fit
    assert plan["estimated_peak_bytes"] <= HEADROOM * gigabytes * GB
    assert (options.grad_accum, options.gradient_checkpointing) == (plan["accumulation"],
                                                                     plan["gradient_checkpointing"])
    shape = shape_of(one_b)  # the largest micro-batch that fits: twice as many windows would not
    if plan["micro_batch"] < 64 and not plan["gradient_checkpointing"]:
        assert estimate_peak(shape, micro_batch=2 * plan["micro_batch"], seq_len=512, checkpointing=False,
                             value_bytes=2, soft_targets=True) > HEADROOM * gigabytes * GB


def test_max_memory_overrides_the_free_memory_and_the_flags_given_stay(one_b):
    options, plan = planned(one_b, 80 * GB, max_memory="24GiB", grad_accum=16, gradient_checkpointing=True)
    assert plan["free_bytes"] == 24 * 2**30 and plan["free_from"] == "--max-memory"
    assert plan["accumulation"] >= 16 and plan["gradient_checkpointing"] and options.gradient_checkpointing


def test_nothing_fits_one_line_naming_the_flags(one_b):
    with pytest.raises(MemoryPlanError) as error:
        planned(one_b, 4 * 2**30, soft_targets=1.0)
    message = str(error.value)
    assert "\n" not in message and "--fsdp" in message and "4.0 GiB are free on cuda" in message
    assert "--max-memory" in message  # the reading may be wrong
    shape = shape_of(one_b)  # a shorter window would fit: said so

    def smallest(seq_len):
        return estimate_peak(shape, micro_batch=1, seq_len=seq_len, checkpointing=True, value_bytes=2,
                             soft_targets=True)
    with pytest.raises(MemoryPlanError, match="try --seq-len 256, --fsdp"):
        planned(one_b, int((smallest(256) + smallest(512)) / 2 / HEADROOM), soft_targets=1.0)


def test_the_cpu_is_not_planned_without_max_memory(one_b):
    options, plan = plan_run(MergeOptions(method="dual", device="cpu"), one_b, 2, progress=False)
    assert plan == {"planned": False, "device": "cpu", "reason": "cpu: planned only with --max-memory"}
    assert options == MergeOptions(method="dual", device="cpu")


def test_a_run_records_its_plan_and_trains_with_it(learned_pair, tmp_path, capsys):
    """--max-memory on the CPU plans: 8 windows of 32 tokens need more than the whole batch's estimate allows, so the
    run accumulates or checkpoints, trains with that, and barrier.json records the plan."""
    from hf_rebasin.sources import models
    template = models.load(learned_pair[0])
    canonical = meta_graph(template)
    shape = step_shape(canonical.spec, {k: tuple(v.shape) for k, v in canonical.params.items()}, 2, "dual")
    whole = estimate_peak(shape, micro_batch=8, seq_len=32, checkpointing=False, value_bytes=4, soft_targets=True)
    half = estimate_peak(shape, micro_batch=4, seq_len=32, checkpointing=False, value_bytes=4, soft_targets=True)
    limit = int((half + whole) / 2 / HEADROOM)
    assert short_dual(learned_pair, tmp_path / "out", "--max-memory", str(limit), "--self-samples-dir",
                      str(tmp_path / "samples")) == 0
    assert "hf-rebasin: memory plan:" in capsys.readouterr().err
    settings = json.loads((tmp_path / "out" / "barrier.json").read_text())["settings"]
    plan = settings["memory_plan"]
    assert plan["planned"] and plan["free_bytes"] == limit and plan["micro_batch"] * plan["accumulation"] == 8
    assert (plan["accumulation"], plan["gradient_checkpointing"]) != (1, False)
    assert settings["learned"]["grad_accum"] == plan["accumulation"]
    assert settings["learned"]["gradient_checkpointing"] == plan["gradient_checkpointing"]
    assert "sampling_peak_bytes" in plan and torch.device(plan["device"]).type == "cpu"


def test_max_memory_must_be_a_size():
    from hf_rebasin.errors import OptionError
    with pytest.raises(OptionError, match="--max-memory: 'lots' is not a size"):
        MergeOptions(method="dual", max_memory="lots").check()
    assert MergeOptions(method="dual", max_memory="24GiB").memory_bytes() == 24 * 2**30
