"""paged_attention with the heads split over a mesh axis (tests/_paged_mesh_cases.py,
8 simulated devices in one subprocess): the one-device result, and for the native
kernel (its FFI call partitioned over heads) no key or value moving between devices."""

import json
import os
import subprocess
import sys

import pytest

from _paths import TESTS


@pytest.fixture(scope="module")
def cases():
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    done = subprocess.run(
        [sys.executable, str(TESTS / "_paged_mesh_cases.py"), "native", "xla"],
        env={**os.environ, "XLA_FLAGS": flags.strip()}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    return {line["case"]: line for line in lines}


@pytest.mark.parametrize("implementation", ["native", "xla"])
def test_heads_split_over_a_mesh_axis_give_the_one_device_result(cases, implementation):
    case = cases[f"heads-{implementation}"]
    assert "raised" not in case, case
    assert case["error"] <= 1e-6 and "'model'" in case["spec"], case


def test_the_native_call_moves_no_key_or_value_between_devices(cases):
    """Its FFI call has a partitioning rule (custom_partitioning): without one XLA
    all-gathers the whole pools onto every device."""
    assert cases["heads-native"]["collectives"] == [], cases["heads-native"]
