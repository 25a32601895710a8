"""Fuzzed config files (hypothesis): every generated workload, hardware or topology file is either
refused with its file, key and reason (ConfigError) or accepted within the cost guards; never a
traceback of another kind, never a hang. Files are the shipped ones mutated: a key set to a value
of another type, zero, negative or absurd; a key deleted; an unknown key added; broken YAML."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings  # pinned in requirements.txt
from hypothesis import strategies as st

from echo.config import CONFIG_ROOT, load_hardware, load_topology, load_workload
from echo.config.limits import cost_problems
from echo.errors import ConfigError

BASES = {
    "workload": ("tiny-dp2", "tiny-tp2pp2", "gpt3-175b", "tiny-hf-qwen3-moe", "llama3.1-70b-h100-64"),
    "hardware": ("h100-sxm-80gb", "a100-sxm-80gb", "local-cpu", "b200-sxm"),
    "topology": ("dgx-h100-ndr", "azure-ndv4", "gb200-nvl72", "local-gloo"),
}
_FOLDER = {"workload": "workloads", "hardware": "hardware", "topology": "topologies"}
_LOAD = {"workload": load_workload, "hardware": load_hardware, "topology": load_topology}
EXAMPLES = 2000

values = st.one_of(
    st.integers(min_value=-(10**12), max_value=10**15), st.sampled_from([0, -1, 1, 10**9, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.none(), st.booleans(),
    st.lists(st.integers(-5, 100), max_size=4), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


def _keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out.append(prefix + str(k))
        if isinstance(v, dict):
            out += _keys(v, prefix + str(k) + ".")
    return out


def _set(d: dict, dotted: str, value, delete: bool = False) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        d = d[p]
    if delete:
        d.pop(last, None)
    else:
        d[last] = value


@st.composite
def config_files(draw):
    kind = draw(st.sampled_from(sorted(BASES)))
    base = draw(st.sampled_from(BASES[kind]))
    data = yaml.safe_load((CONFIG_ROOT / _FOLDER[kind] / f"{base}.yaml").read_text())
    keys = _keys(data)
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["set", "set", "set", "delete", "unknown"]))
        keys = _keys(data) or keys
        key = draw(st.sampled_from(keys))
        try:
            if action == "unknown":
                _set(data, key.rsplit(".", 1)[0] + ".zz_unknown" if "." in key else "zz_unknown", draw(values))
            else:
                _set(data, key, draw(values), delete=action == "delete")
        except (KeyError, TypeError, AttributeError):  # the parent was replaced by a scalar already
            pass
    text = yaml.safe_dump(data, sort_keys=False)
    if draw(st.integers(0, 19)) == 0:  # broken YAML now and then
        text = text[: draw(st.integers(0, len(text)))] + draw(st.sampled_from([": [", "\t- {", "'", "@"]))
    return kind, text


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    r = tmp_path_factory.mktemp("fuzz") / "config"
    shutil.copytree(CONFIG_ROOT, r)
    return r


def test_fuzzed_configs_are_refused_clearly_or_accepted_within_the_guards(root: Path):
    seen = {"refused": 0, "accepted": 0}

    @settings(max_examples=EXAMPLES, deadline=60_000, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(config_files())
    def check(case):
        kind, text = case
        path = root / _FOLDER[kind] / f"fuzz-{kind}.yaml"
        path.write_text(text)
        try:
            loaded = _LOAD[kind](f"fuzz-{kind}", root=root)
        except ConfigError as exc:
            assert path.name in exc.file and exc.key and exc.reason, exc
            seen["refused"] += 1
            return
        if kind == "workload":
            assert cost_problems(loaded) == []
        seen["accepted"] += 1

    check()
    assert seen["refused"] + seen["accepted"] >= EXAMPLES
    assert seen["refused"] > 0 and seen["accepted"] > 0
