"""Compiled steps: the packed step compiled by `torch.compile` in a thread of its own while steps run eagerly.

The reference is the eager step of the same model. A compiled step runs none of the model's Python: counting calls of
`packed_attention` (which the eager step calls once per layer) tells the two apart.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.profiler import ProfilerActivity, profile
from transformers import PreTrainedTokenizerFast

from prefixgate.backends import attention as attention_module
from prefixgate.backends import model_runner, packed_linear
from prefixgate.backends.model_runner import ModelRunner, StepInput
from prefixgate.backends.packed_linear import PackedLinear, applies
from tests.backends.conftest import BackendFactory
from tests.backends.streams import collect
from tests.backends.test_kv_reuse import make_prompt
from tests.backends.tiny_models import as_blocks, make_llama


@contextmanager
def attention_calls() -> Iterator[list[int]]:
    """Count this thread's calls of `packed_attention`, the Python an eager step runs once per layer."""
    calls: list[int] = []
    code = attention_module.packed_attention.__code__

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is code:
            calls.append(1)

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


def test_compiled_steps_give_the_logits_of_eager_ones_for_every_shape_of_step(
    make_backend: BackendFactory, tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    compile_now, asked = torch.compile, []

    def noted(function: Any, **options: Any) -> Any:
        asked.append(dict(options["options"]))  # a copy: torch.compile takes the guard filter out of it
        return compile_now(function, **options)

    monkeypatch.setattr(model_runner.torch, "compile", noted)
    model = make_llama(tokenizer)
    backend = make_backend(model, compile_steps=True)
    assert backend.compiling is not None
    backend.compiling.join()
    assert backend.steps == "compiled"
    # The modules unguarded, and on a CPU the graph's calls in C++: what follows checks such graphs.
    assert asked == [{"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "cpp_wrapper": True}]
    compiled, eager = backend._runner, ModelRunner(model)  # one model: the second runner runs its step eagerly
    g = backend.geometry
    root = torch.randn((g.layers, 2, g.kv_heads, 16, g.head_dim))  # a shared prefix of 16 positions
    prompt = make_prompt(40)
    steps: list[Callable[[list[torch.Tensor]], list[StepInput]]] = [
        lambda kv: [StepInput(prompt[:1], kv[0], 0)],  # one token alone (a graph of its own)
        lambda kv: [StepInput(prompt[:13], kv[0], 0)],  # a prompt chunk alone
        lambda kv: [StepInput(prompt[5:6], kv[i], 20 + i) for i in range(3)],  # three decoding streams
        lambda kv: [  # two streams on a shared prefix, one of them a chunk, beside one that reads none
            StepInput(prompt[:4], kv[0], 16, 16, (root,)),
            StepInput(prompt[:1], kv[1], 30, 16, (root,)),
            StepInput(prompt[:7], kv[2], 9),
        ],
        # every position's logits of a chunk (a prompt's log probabilities), beside a decoding stream, and alone
        lambda kv: [StepInput(prompt[:9], kv[0], 0, every_logit=True), StepInput(prompt[5:6], kv[1], 20)],
        lambda kv: [StepInput(prompt[:1], kv[0], 0, every_logit=True)],
    ]
    for step in steps:
        buffers = [torch.randn((g.layers, 2, g.kv_heads, 40, g.head_dim)) for _ in range(3)]
        copies = [buffer.clone() for buffer in buffers]
        with torch.inference_mode(), attention_calls() as calls, profile(activities=[ProfilerActivity.CPU]) as ran:
            logits = compiled.run(step(buffers))
        assert calls == []  # no layer ran its Python: the compiled graph took the step
        # The rotary angles go through the operator that makes them a buffer, once a step, not once a layer.
        assert {event.key: event.count for event in ran.key_averages()}.get("prefixgate::stored") == 1
        with torch.inference_mode(), attention_calls() as calls:
            expected = eager.run(step(copies))
        assert len(calls) == g.layers
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        for buffer, copy in zip(buffers, copies, strict=True):
            torch.testing.assert_close(buffer, copy, atol=1e-5, rtol=0)  # each wrote the same K and V


@pytest.mark.skipif(not packed_linear.bfloat16_products(), reason="the linear kernel takes no bfloat16 here")
def test_compiled_bfloat16_steps_reach_the_linear_kernel_and_onednn_through_it_and_give_the_eager_logits(
    make_backend: BackendFactory, tokenizer: PreTrainedTokenizerFast
) -> None:
    # Up to `pair_rows()` rows a product runs on the kernel's pair panels (8 with AMX, 64 on dot products without it,
    # every count on FMAs), more on oneDNN's layout called from the same C++ operator: a compiled step calls it either
    # way, with no branch on the row count in the graph.
    model = as_blocks(make_llama(tokenizer), torch.bfloat16)
    backend = make_backend(model, compile_steps=True, prepack_weights=True)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert backend.prepacked == len(layers) > 0 and all("pairs" in layer.layout for layer in layers)
    assert backend.compiling is not None
    backend.compiling.join()
    assert backend.steps == "compiled"
    compiled, eager = backend._runner, ModelRunner(model)
    g = backend.geometry
    most = packed_linear.pair_rows()
    rows = most or 64  # and one row more

    def past(count: int) -> bool:
        return most is not None and count > most

    prompt = make_prompt(rows + 8)
    for step, onednn in (
        (lambda kv: [StepInput(prompt[:1], kv[0], 0)], False),  # one row
        (lambda kv: [StepInput(prompt[5:6], kv[i], 20 + i) for i in range(3)], False),  # three decoding streams
        (lambda kv: [StepInput(prompt[:13], kv[0], 0), StepInput(prompt[5:6], kv[1], 20)], past(14)),  # 14 rows
        (lambda kv: [StepInput(prompt[:rows], kv[0], 0), StepInput(prompt[5:6], kv[1], 20)], past(rows + 1)),
    ):
        buffers = [torch.randn((g.layers, 2, g.kv_heads, rows + 8, g.head_dim), dtype=torch.bfloat16) for _ in range(3)]
        copies = [buffer.clone() for buffer in buffers]
        with torch.inference_mode(), attention_calls() as calls, profile(activities=[ProfilerActivity.CPU]) as ran:
            logits = compiled.run(step(buffers))
        assert calls == []
        counts = {event.key: event.count for event in ran.key_averages()}
        assert counts.get("prefixgate::linear_panels") == len(layers)  # every product through the operator
        # past `pair_rows()` rows, oneDNN's: every layer's but the output projection's, which takes a row per sequence
        assert counts.get("mkldnn::_linear_pointwise", 0) == (len(layers) - 1 if onednn else 0)
        with torch.inference_mode():
            expected = eager.run(step(copies))
        # Compiled and eager bfloat16 round what runs between the products differently (here up to 4.5 units in the
        # last place of the largest logits, with oneDNN's products alone as with the kernel's): within 5% of them.
        assert float((logits.float() - expected.float()).abs().max()) <= 0.05 * float(expected.float().abs().max())


# Compiles the tiny model's step in bfloat16, its products on the linear kernel's operator, and prints how many of its
# graphs torch's compile cache served.
COMPILE_ONCE = """
import torch
from torch._dynamo.utils import counters
from prefixgate.backends import HFBackend
from tests.backends.tiny_models import as_blocks, make_llama, make_tokenizer

tokenizer = make_tokenizer()
model = as_blocks(make_llama(tokenizer), torch.bfloat16)
backend = HFBackend(model, tokenizer, model_id="tiny", block_size=8, compile_steps=True, prepack_weights=True)
backend.wait_compiled()
assert backend.steps == "compiled", backend.steps
print(counters["inductor"]["fxgraph_cache_hit"])
backend.close()
"""


@pytest.mark.skipif(not packed_linear.bfloat16_products(), reason="the linear kernel takes no bfloat16 here")
def test_a_later_process_takes_the_compiled_step_from_torchs_compile_cache(tmp_path: Path) -> None:
    # The linear kernel's operator once took each weight's description by its address: a constant of the graph that
    # differed in every process, so the cache never served a later one; it takes the layer's number now.
    environment = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    root = Path(__file__).resolve().parent.parent.parent
    runs = [
        subprocess.run(
            [sys.executable, "-c", COMPILE_ONCE], env=environment, cwd=root, capture_output=True, text=True, check=False
        )
        for _ in range(2)
    ]
    assert [run.returncode for run in runs] == [0, 0], runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    assert [int(run.stdout.split()[-1]) for run in runs] == [0, 2]  # both graphs from the cache the second time


def test_two_models_in_one_process_each_run_graphs_of_their_own(
    make_backend: BackendFactory, tokenizer: PreTrainedTokenizerFast
) -> None:
    # Their modules go unguarded, so nothing but the runner's own compiled code tells the second model's steps from
    # the first's graphs: one of 2 layers, one of 3.
    models = [make_llama(tokenizer, seed=1), make_llama(tokenizer, seed=2, num_hidden_layers=3)]
    prompt = make_prompt(12)
    for model in models:
        backend = make_backend(model, compile_steps=True)
        assert backend.compiling is not None
        backend.compiling.join()
        assert backend.steps == "compiled"
        g = backend.geometry
        buffers = [torch.zeros((g.layers, 2, g.kv_heads, 16, g.head_dim)) for _ in range(2)]
        with torch.inference_mode(), attention_calls() as calls:
            logits = backend._runner.run([StepInput(prompt, buffers[0], 0)])
        assert calls == []
        with torch.inference_mode():
            expected = ModelRunner(model).run([StepInput(prompt, buffers[1], 0)])
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(buffers[0], buffers[1], atol=1e-4, rtol=0)


async def test_steps_run_eagerly_while_compiling_and_compiled_after(
    make_backend: BackendFactory, tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiling, release = threading.Event(), threading.Event()
    compile_now = torch.compile

    def held(function: Any, **options: Any) -> Any:
        compiling.set()
        release.wait()
        return compile_now(function, **options)

    monkeypatch.setattr(model_runner.torch, "compile", held)
    backend = make_backend(make_llama(tokenizer), compile_steps=True)
    compiling.wait()
    prompt = make_prompt(20)
    before = await collect(backend, prompt)  # while the compile thread is held: eager steps
    assert backend.steps == "compiling" and before.token_ids
    release.set()
    assert backend.compiling is not None
    backend.compiling.join()
    assert backend.steps == "compiled"
    assert (await collect(backend, prompt)).token_ids == before.token_ids


async def test_a_failure_to_compile_leaves_the_steps_eager_with_one_log_line(
    make_backend: BackendFactory,
    tokenizer: PreTrainedTokenizerFast,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(function: Any, **options: Any) -> Any:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(model_runner.torch, "compile", broken)
    with caplog.at_level(logging.INFO, logger="prefixgate.backends.hf_backend"):
        backend = make_backend(make_llama(tokenizer), compile_steps=True)
        assert backend.compiling is not None
        backend.compiling.join()
    assert backend.steps == "eager"
    assert [record.getMessage() for record in caplog.records] == [
        "compiling the model's step failed, so it runs eagerly: RuntimeError: no compiler here"
    ]
    assert (await collect(backend, make_prompt(20))).token_ids


def test_auto_compiles_where_linear_weights_are_packed(
    make_backend: BackendFactory, tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[object] = []

    def noted(function: Any, **options: Any) -> Any:
        started.append(function)
        raise RuntimeError("not compiled in this test")

    monkeypatch.setattr(model_runner.torch, "compile", noted)
    unpacked = make_backend(make_llama(tokenizer), compile_steps="auto", prepack_weights=False)
    assert (unpacked.steps, unpacked.compiling, unpacked.prepacked) == ("eager", None, 0)
    compiled = 0
    # float32 is packed on AMD's CPUs (and elsewhere as GGUF codes where the kernel builds), bfloat16 where oneDNN
    # computes it
    for dtype in (torch.float32, torch.bfloat16):
        llama = as_blocks(make_llama(tokenizer), dtype)
        packed_here = applies(llama)
        backend = make_backend(llama, compile_steps="auto", prepack_weights=True)
        assert (backend.prepacked > 0, backend.compiling is not None) == (packed_here, packed_here)
        if backend.compiling is not None:
            backend.compiling.join()  # it tried, and the stub refused
            assert backend.steps == "eager"
            compiled += 1
    assert len(started) == compiled


def test_an_eager_step_waits_for_a_trace_in_another_thread_where_unguarded_it_failed(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    runner = ModelRunner(make_llama(tokenizer))
    model_runner._trace_alone()  # as compiling a step does
    inside, leave = threading.Event(), threading.Event()

    class Held(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inside.set()
            assert leave.wait(60), "the test never let the trace end"
            return x + 1

    tracing = threading.Thread(target=torch.fx.symbolic_trace, args=(Held(),))
    tracing.start()
    assert inside.wait(60)
    ids, positions, last = torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 2]]), torch.tensor([2])
    # Every module call in the process goes through the tracer while it traces: the model's calls fail there.
    with pytest.raises(NameError, match="not installed as a submodule"):
        runner._eager(ids, positions, last)
    assert not model_runner._TRACING.acquire(blocking=False)  # the trace holds the lock an eager step takes
    done: list[torch.Tensor] = []
    stepping = threading.Thread(target=lambda: done.append(runner._eager_alone(ids, positions, last)))
    stepping.start()
    leave.set()
    tracing.join()
    stepping.join()
    assert done and done[0].shape == (1, 1, len(tokenizer))
    assert torch.equal(done[0], runner._eager(ids, positions, last))  # the step it would have run alone


def test_an_eager_step_runs_beside_a_make_fx_trace_which_runs_every_module_as_called(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    # make_fx's traces (AOT autograd's of the whole step, seconds long) replace every module's call too, but run each
    # module as it is: an eager step goes on through them, and waits for nothing.
    runner = ModelRunner(make_llama(tokenizer))
    ids, positions, last = torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 2]]), torch.tensor([2])
    alone = runner._eager(ids, positions, last)
    model_runner._trace_alone()
    call = torch.nn.Module.__call__
    inside, leave = threading.Event(), threading.Event()

    def held(x: torch.Tensor) -> torch.Tensor:
        inside.set()
        assert leave.wait(60), "the test never let the trace end"
        return torch.nn.ReLU()(x)

    tracing = threading.Thread(target=make_fx(held), args=(torch.ones(2),))
    tracing.start()
    try:
        assert inside.wait(60)
        assert torch.nn.Module.__call__ is not call  # the trace has replaced every module's call
        done: list[torch.Tensor] = []
        stepping = threading.Thread(target=lambda: done.append(runner._eager_alone(ids, positions, last)))
        stepping.start()
        stepping.join(60)  # within the trace: it is held until `leave`
        assert done, "the eager step waited for the trace"
        assert torch.equal(done[0], alone)
    finally:
        leave.set()
        tracing.join()
