"""The policy table: one row per policy, acting through the small interface each debugger
implements; config.POLICIES (what DebugConfig accepts) names the same rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_debug import DebugConfig
from diffusion_debug.config import POLICIES
from diffusion_debug.core import POLICY_TABLE, Policy, apply_policy, check_policy
from diffusion_debug.errors import ConfigError, DiffusionDebugError
from diffusion_debug.record import make_anomaly


def error():
    return make_anomaly("nonfinite", message="unet produced NaN.", component="unet", module="conv", step=3)


class Target:
    """A debugger as the table sees it: each action only says it was called."""

    def __init__(self, tmp_path: Path, can_stop: bool = True):
        self.calls: list[str] = []
        self.tmp_path, self.can_stop = tmp_path, can_stop

    def save_run(self) -> Path:
        self.calls.append("save_run")
        return self.tmp_path

    def agree(self) -> None:
        self.calls.append("agree")

    def skip_step(self, errors) -> None:
        self.calls.append(f"skip_step {len(errors)}")

    def stop(self, anomaly) -> str | None:
        self.calls.append(f"stop {anomaly.kind}")
        return None if self.can_stop else " (no interrupt flag)"


def test_the_table_holds_every_policy_the_config_accepts():
    assert tuple(POLICY_TABLE) == POLICIES


@pytest.mark.parametrize(
    "policy, action, calls",
    [
        ("record", None, []),
        ("warn", None, []),
        ("skip", "skip", ["skip_step 1"]),
        ("stop", "stop", ["stop nonfinite"]),
    ],
)
def test_each_row_calls_its_interface_methods(tmp_path, policy, action, calls):
    target = Target(tmp_path)
    assert apply_policy(DebugConfig(policy=policy, output_dir=str(tmp_path)), target, [error()]) == action
    assert target.calls == calls
    assert apply_policy(DebugConfig(policy=policy, output_dir=str(tmp_path)), target, []) is None  # no error
    assert target.calls == calls


def test_raise_saves_agrees_then_raises_and_stop_raises_where_it_cannot_stop(tmp_path):
    target = Target(tmp_path)
    with pytest.raises(DiffusionDebugError, match=r"nonfinite at unet.conv, step 3: unet produced NaN\.") as caught:
        apply_policy(DebugConfig(policy="raise", output_dir=str(tmp_path)), target, [error()])
    assert target.calls == ["save_run", "agree"] and caught.value.run_dir == tmp_path
    stuck = Target(tmp_path, can_stop=False)
    with pytest.raises(DiffusionDebugError, match=r"\(no interrupt flag\)"):
        apply_policy(DebugConfig(policy="stop", output_dir=str(tmp_path)), stuck, [error()])
    assert stuck.calls == ["stop nonfinite", "save_run", "agree"]


def test_a_new_policy_is_one_row_and_a_debugger_without_its_method_is_refused(tmp_path, monkeypatch):
    def pause(target, errors):
        target.pause(errors[0])
        return "pause"

    monkeypatch.setitem(POLICY_TABLE, "pause", Policy("pause", pause, needs="pause", refusal="nothing to pause"))
    monkeypatch.setattr("diffusion_debug.config.POLICIES", (*POLICIES, "pause"))
    config = DebugConfig(policy="pause", output_dir=str(tmp_path))

    class Pausing(Target):
        def pause(self, anomaly) -> None:
            self.calls.append(f"pause {anomaly.step}")

    target = Pausing(tmp_path)
    check_policy(config, Pausing, "Pausing")
    assert apply_policy(config, target, [error()]) == "pause" and target.calls == ["pause 3"]
    with pytest.raises(ConfigError, match="^Policy 'pause' cannot be used with Target: nothing to pause.$"):
        check_policy(config, Target, "Target")


@pytest.mark.parametrize("strict", [False, True])
def test_a_guard_records_a_failed_measurement_and_lets_other_errors_through(tmp_path, strict):
    import logging

    from diffusion_debug.core import AnomalySink
    from diffusion_debug.record import RunRecord

    record = RunRecord(DebugConfig(output_dir=str(tmp_path), strict=strict), kind="diffusion")
    sink = AnomalySink(record, record.config, logging.getLogger("test"))
    with sink.guard("fine", step=1):
        pass
    if strict:
        with pytest.raises(ZeroDivisionError):
            with sink.guard("probe", step=3):
                1 / 0
    else:
        with sink.guard("probe", step=3, rank=0):
            1 / 0
    for passing in (DiffusionDebugError("policy"), KeyboardInterrupt()):  # never swallowed
        with pytest.raises(type(passing)):
            with sink.guard("probe"):
                raise passing
    found = [
        (a.kind, a.step, a.details["where"], a.details["error"], a.details.get("raised")) for a in record.anomalies
    ]
    # recorded once either way; with strict it was raised too, and says so
    assert found == [("debugger_error", 3, "probe", "ZeroDivisionError: division by zero", True if strict else None)]
    record.close()
