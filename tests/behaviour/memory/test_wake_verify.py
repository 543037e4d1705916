"""Verified wakes (``sleep.verify_wake``) and warm-up by pooling task.

Component tests run the fake engine as a real subprocess: ``FAKE_ENGINE_WAKE_CORRUPTS`` makes
its answers wrong (HTTP 200) after a wake from the given levels, as a vLLM engine that restored
its weights wrongly would. Unit tests cover the comparison and the task detection.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from kit import SLEEPY, FakeEngine, RunningProxy, StartProxy, sleepy, wait_for
from kit import sleep_config as config
from kit.metrics import engine_metric, proxy_metric

from vllm_proxy.config import parse_config
from vllm_proxy.engines import oracle as oracle_module
from vllm_proxy.engines.breaker import WakeBreaker
from vllm_proxy.engines.instance import Instance
from vllm_proxy.engines.oracle import LOGPROB_TOLERANCE, VECTOR_TOLERANCE, Oracle, mismatch
from vllm_proxy.engines.states import State


async def asleep(inst: Instance) -> None:
    await wait_for(lambda: inst.asleep, what=f"{inst.id} asleep")


async def failures(proxy: RunningProxy, level: str) -> float | None:
    series = "vllm_proxy_wake_verify_failures_total"
    return await proxy_metric(proxy, series, model_id="m", level=level)


async def checks(proxy: RunningProxy) -> float | None:
    return await proxy_metric(proxy, "vllm_proxy_wake_verify_seconds_count", model_id="m")


async def post(proxy: RunningProxy, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with proxy.http.post(proxy.url + path, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


# -- the check after a wake -------------------------------------------------------------------


@pytest.mark.parametrize("level", [1, 2])
async def test_a_wake_that_corrupts_output_never_reaches_a_client(
    tmp_path: Path, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture, level: int
) -> None:
    env = FakeEngine(wake_corrupts="all").env()
    cfg = config(tmp_path, {"m": sleepy({**SLEEPY, "level": level}, env=env)})
    proxy, first = await start_proxy.serving(cfg, "m")
    assert first.oracle is not None and first.oracle.tokens, "recorded at the start"
    await asleep(first)
    with caplog.at_level(logging.ERROR, logger="vllm_proxy.engines.instance"):
        status, text = await proxy.reply("m", max_tokens=4)
    assert status == 200 and text == "tok0 tok1 tok2 tok3 ", "a cold-started engine's answer"
    assert first.state is State.STOPPED and first.engine is not None
    assert first.engine.exit_code is not None, "the engine that woke wrong is gone"
    assert proxy.instance("m") is not first and proxy.engine_starts("m") == 2
    assert await failures(proxy, str(level)) == 1
    restarts = "vllm_proxy_engine_restarts_total"
    assert await proxy_metric(proxy, restarts, model_id="m", reason="wake_verify_failed") == 1
    assert await proxy_metric(proxy, restarts, model_id="m", reason="wake_failed") is None
    line = next(r.getMessage() for r in caplog.records if "oracle mismatch" in r.getMessage())
    assert "model m:" in line and f"level {level}" in line
    assert "first differing token at position 0" in line
    assert "<garbage>" not in line, "the engine's output stays out of the log"


async def serving_after_idle(proxy: RunningProxy) -> Instance:
    """The model's instance once idle has done what it does: asleep, or (a level no longer
    used) kept awake."""
    inst = proxy.instance("m")
    await wait_for(
        lambda: inst.asleep or (inst.state is State.RUNNING and inst.usable_level() is None),
        what=f"{inst.id} asleep, or awake with no sleep level left",
    )
    return inst


async def test_wakes_that_always_fail_the_check_stop_costing_cold_starts(
    tmp_path: Path, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (F2): every wake of a model whose wakes all answer wrongly cost a wake, a stop
    and a cold start, for ever (8 request-then-idle cycles: 9 engine starts). Now level 1 is
    barred after two failures in a row, level 2 (it reloads) after its first, and the model is
    then kept awake as with ``sleep: null``; an operator can clear it."""
    env = FakeEngine(wake_corrupts="all").env()
    proxy = await start_proxy(config(tmp_path, {"m": sleepy(env=env)}))
    with caplog.at_level(logging.ERROR, logger="vllm_proxy.engines.instance"):
        for _cycle in range(8):
            status, text = await proxy.reply("m", max_tokens=4)
            assert status == 200 and text == "tok0 tok1 tok2 tok3 ", "never a wrong answer"
            await serving_after_idle(proxy)
    assert proxy.engine_starts("m") == 4, "1 + 2 failed level-1 wakes + 1 failed level-2 wake"
    inst = proxy.instance("m")
    assert inst.state is State.RUNNING and inst.usable_level() is None
    assert await failures(proxy, "1") == 2 and await failures(proxy, "2") == 1
    barred = "vllm_proxy_sleep_level_barred"
    assert await proxy_metric(proxy, barred, model_id="m", level="1") == 1
    assert await proxy_metric(proxy, barred, model_id="m", level="2") == 1
    said = [
        r.getMessage() for r in caplog.records if "kept failing the wake check" in r.getMessage()
    ]
    assert any("level 1" in m and "sleeps at level 2 instead" in m for m in said), said
    assert any("level 2" in m and "no longer sleeps" in m for m in said), said
    async with proxy.http.get(proxy.url + "/admin/models/m") as resp:
        row = await resp.json()
    assert row["wake_check"]["barred_levels"] == [1, 2]
    status, answer = await post(proxy, "/admin/models/m/sleep", {})
    assert status == 409 and answer["error"]["code"] == "sleep_level_barred", answer
    # An operator clears it: the idle engine is put to sleep again.
    status, answer = await post(proxy, "/admin/models/m/wake_check/clear", {})
    assert status == 200 and answer["cleared_levels"] == [1, 2]
    assert await proxy_metric(proxy, barred, model_id="m", level="1") == 0
    await asleep(inst)
    assert inst.sleep_level == 1


async def test_a_check_that_differs_once_is_asked_again(
    tmp_path: Path, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A near-tie that flips once must not cost a cold start: the check is asked once more."""
    proxy, inst = await start_proxy.serving(config(tmp_path, {"m": sleepy()}), "m")
    await asleep(inst)
    real = oracle_module.take
    answers: list[Oracle] = []

    async def flips_once(engine: Any, client: Any) -> Oracle:
        got = await real(engine, client)
        answers.append(got)
        return Oracle(tokens=(-1,)) if len(answers) == 1 else got

    monkeypatch.setattr(oracle_module, "take", flips_once)
    assert (await proxy.reply("m"))[0] == 200
    assert len(answers) == 2, "asked twice"
    assert proxy.instance("m") is inst and proxy.engine_starts("m") == 1, "woken, not restarted"
    assert await failures(proxy, "1") is None


def test_the_breaker() -> None:
    key = ("m", "engine")
    b = WakeBreaker()
    assert b.allowed(key, 1, reloadable=True) == 1
    assert not b.failed(key, 1)
    b.passed(key, 1)  # a verified wake: the failures in a row start again
    assert not b.failed(key, 1)
    assert b.failed(key, 1), "two in a row bar level 1"
    assert b.allowed(key, 1, reloadable=True) == 2
    assert b.allowed(key, 1, reloadable=False) is None, "no reload: no sleep at all"
    assert b.allowed(("m", "other engine"), 1, reloadable=True) == 1, "per engine"
    assert b.failed(key, 2), "the level standing in is barred at its first failure"
    assert b.allowed(key, 1, reloadable=True) is None and b.allowed(key, 2, True) is None
    assert b.status("m") == {"barred_levels": [1, 2], "failures_in_a_row": {"1": 2, "2": 1}}
    assert b.clear("m") == [1, 2] and b.allowed(key, 1, reloadable=True) == 1
    assert b.status("m") == {"barred_levels": [], "failures_in_a_row": {}}


def test_data_parallel_experts_compare_the_first_token_only() -> None:
    base = Oracle(tokens=(1, 2, 3), logprobs=(-0.1, -0.2, -0.3))
    drifted = Oracle(tokens=(1, 5, 6), logprobs=(-0.1, -0.9, -0.3))
    assert mismatch(base, drifted) is not None
    assert mismatch(base, drifted, first_only=True) is None
    assert mismatch(base, Oracle(tokens=(4, 2, 3)), first_only=True) is not None
    spec = parse_config(
        {"models": {"m": {"model": "x", "args": {"data_parallel_size": 2,
                                                  "enable_expert_parallel": True}}}}
    ).specs()["m"]  # fmt: skip
    assert spec.expert_data_parallel
    assert not parse_config({"models": {"m": {"model": "x"}}}).specs()["m"].expert_data_parallel


async def test_a_normal_wake_passes_the_check(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy, inst = await start_proxy.serving(config(tmp_path, {"m": sleepy()}), "m")
    await asleep(inst)
    assert (await proxy.reply("m"))[0] == 200
    assert proxy.instance("m") is inst and proxy.engine_starts("m") == 1, "woken, not restarted"
    assert await checks(proxy) == 1
    assert await failures(proxy, "1") is None
    # The check at the start, the client, the check after the wake, the client.
    assert await engine_metric(proxy, inst, "vllm:request_success_total") == 4


async def test_verify_wake_false_skips_the_check(tmp_path: Path, start_proxy: StartProxy) -> None:
    """Without the check, the wrong answers of a broken wake reach the client: what the check
    is there for."""
    env = FakeEngine(wake_corrupts="1").env()
    cfg = config(tmp_path, {"m": sleepy({**SLEEPY, "verify_wake": False}, env=env)})
    proxy, inst = await start_proxy.serving(cfg, "m")
    assert inst.oracle is None
    await asleep(inst)
    status, text = await proxy.reply("m")
    assert status == 200 and "<garbage>" in text
    assert proxy.instance("m") is inst and proxy.engine_starts("m") == 1
    assert await checks(proxy) is None
    assert await engine_metric(proxy, inst, "vllm:request_success_total") == 2


async def test_the_check_replaces_the_wake_warm_up(tmp_path: Path, start_proxy: StartProxy) -> None:
    proxy, inst = await start_proxy.serving(config(tmp_path, {"m": sleepy(warmup=True)}), "m")
    # Warm-up, check request, client.
    assert await engine_metric(proxy, inst, "vllm:request_success_total") == 3
    await asleep(inst)
    assert (await proxy.reply("m"))[0] == 200
    # The check after the wake warms it up: one request before the client's, not two.
    assert await engine_metric(proxy, inst, "vllm:request_success_total") == 5


@pytest.mark.parametrize("corrupts", [False, True])
async def test_a_pooling_model_is_checked_by_its_answer(
    tmp_path: Path, start_proxy: StartProxy, corrupts: bool
) -> None:
    env = FakeEngine(wake_corrupts="1" if corrupts else None).env()
    model = sleepy(env=env, args={"convert": "classify"})
    proxy = await start_proxy(config(tmp_path, {"m": model}))
    body = {"model": "m", "input": "is this good"}
    status, first_answer = await post(proxy, "/classify", body)
    assert status == 200, first_answer
    inst = proxy.instance("m")
    assert inst.oracle is not None and len(inst.oracle.numbers) == 2, "two class probabilities"
    await asleep(inst)
    status, answer = await post(proxy, "/classify", body)
    assert status == 200 and answer["data"] == first_answer["data"], "never a wrong answer"
    assert proxy.engine_starts("m") == (2 if corrupts else 1)
    assert await failures(proxy, "1") == (1 if corrupts else None)
    assert await checks(proxy) == 1


async def test_an_answer_that_cannot_be_recorded_leaves_wakes_unchecked(
    tmp_path: Path, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """A plugin pooling task takes inputs only its plug-in knows: no check request can be made.
    The start does not fail for that; it is logged, and the wakes are not checked."""
    args = {"runner": "pooling", "pooler_config": {"task": "plugin"}}
    with caplog.at_level(logging.WARNING, logger="vllm_proxy.engines.instance"):
        proxy = await start_proxy(config(tmp_path, {"m": sleepy(warmup=True, args=args)}))
        status, answer = await post(proxy, "/pooling", {"model": "m", "input": "x"})
    assert status == 200, answer
    inst = proxy.instance("m")
    assert inst.oracle is None
    assert any("its wakes will not be checked" in r.getMessage() for r in caplog.records)
    await asleep(inst)
    assert (await post(proxy, "/pooling", {"model": "m", "input": "x"}))[0] == 200
    assert proxy.instance("m") is inst and proxy.engine_starts("m") == 1
    assert await checks(proxy) is None


# -- warm-up by pooling task ------------------------------------------------------------------


async def test_a_classification_model_warms_up_through_classify(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """Regression: the warm-up of every pooling model was an embedding; vLLM has no
    /v1/embeddings for a classification model (404), so with `warmup: true` it never started."""
    models = {"c": {"model": "x", "warmup": True, "args": {"convert": "classify"}}}
    proxy = await start_proxy(config(tmp_path, models))
    status, answer = await post(proxy, "/classify", {"model": "c", "input": "is this good"})
    assert status == 200, answer
    assert answer["data"][0]["num_classes"] == 2 and len(answer["data"][0]["probs"]) == 2
    assert proxy.engine_starts("c") == 1 and proxy.instance("c").state is State.RUNNING
    status, _ = await post(proxy, "/v1/embeddings", {"model": "c", "input": "hello"})
    assert status == 404, "as vLLM: no embeddings route for the classify task"


async def test_a_token_classification_model_warms_up_through_pooling(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    args = {"runner": "pooling", "pooler_config": {"task": "token_classify"}}
    proxy = await start_proxy(config(tmp_path, {"r": {"model": "x", "warmup": True, "args": args}}))
    status, answer = await post(proxy, "/pooling", {"model": "r", "input": "hello"})
    assert status == 200 and answer["data"][0]["data"], answer
    assert proxy.engine_starts("r") == 1
    for path in ("/classify", "/v1/embeddings"):
        assert (await post(proxy, path, {"model": "r", "input": "x"}))[0] == 404


# -- units ------------------------------------------------------------------------------------


def test_the_comparison() -> None:
    base = Oracle(tokens=(1, 2, 3, 4), logprobs=(-0.1, -0.2, -0.3, -0.4))
    assert mismatch(base, base) is None
    near = Oracle(tokens=(1, 2, 3, 4), logprobs=(-0.1, -0.2 - LOGPROB_TOLERANCE / 2, -0.3, -0.4))
    assert mismatch(base, near) is None
    far = Oracle(tokens=(1, 2, 3, 4), logprobs=(-0.1, -0.2, -0.3, -2.0))
    assert mismatch(base, far) == "log-probability of token 3 off by 1.6"
    nan = Oracle(tokens=(1, 2, 3, 4), logprobs=(-0.1, float("nan"), -0.3, -0.4))
    assert mismatch(base, nan) == "log-probability of token 1 off by nan"
    other = Oracle(tokens=(1, 2, 9, 4), logprobs=base.logprobs)
    assert mismatch(base, other) == "first differing token at position 2"
    assert mismatch(base, Oracle(tokens=(1, 2))) == "2 tokens instead of 4"
    # An engine that gives no log-probabilities is compared by its tokens alone.
    assert mismatch(base, Oracle(tokens=(1, 2, 3, 4))) is None
    vector = Oracle(numbers=(0.5, 0.5))
    assert mismatch(vector, Oracle(numbers=(0.5, 0.5 + VECTOR_TOLERANCE / 2))) is None
    assert mismatch(vector, Oracle(numbers=(0.1, 0.9))) == "number 0 off by 0.4"
    assert mismatch(vector, Oracle(numbers=(0.5,))) == "1 numbers instead of 2"


@pytest.mark.parametrize(
    ("args", "architecture", "task"),
    [
        ({}, None, None),
        ({"runner": "pooling"}, None, "pooling"),
        ({"convert": "classify"}, None, "classify"),
        ({"convert": "embed"}, "LlamaForCausalLM", "embed"),
        ({"runner": "pooling", "pooler_config": {"task": "token_embed"}}, None, "token_embed"),
        ({"runner": "pooling", "pooler_config": '{"task": "classify"}'}, None, "classify"),
        ({}, "Qwen2ForSequenceClassification", "classify"),
        ({}, "Qwen2ForRewardModel", "token_classify"),
        ({}, "BertForTokenClassification", "token_classify"),
        ({}, "XLMRobertaModel", "embed"),
        ({}, "LlamaForCausalLM", None),
        ({"runner": "generate"}, "Qwen2ForSequenceClassification", None),
        ({"runner": "pooling"}, "SomethingForRewardModeling", "pooling"),
    ],
)
def test_the_pooling_task(
    tmp_path: Path, args: dict[str, Any], architecture: str | None, task: str | None
) -> None:
    model = "x"
    if architecture is not None:
        (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
        model = str(tmp_path)
    spec = parse_config({"models": {"m": {"model": model, "args": args}}}).specs()["m"]
    assert spec.pooling_task == task
    assert spec.pooling is (task is not None)


def test_verify_wake_is_a_sleep_setting(tmp_path: Path) -> None:
    cfg = parse_config(
        {
            "engine": {"sleep": {"level": 1}},
            "models": {
                "on": {"model": "x"},
                "off": {"model": "x", "sleep": {"verify_wake": False}},
                "awake": {"model": "x", "sleep": None},
            },
        }
    )
    specs = cfg.specs()
    assert specs["on"].verify_wake is True, "on by default"
    assert specs["off"].verify_wake is False
    assert specs["awake"].verify_wake is False, "nothing to check without sleep"
