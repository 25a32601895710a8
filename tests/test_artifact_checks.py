"""Artifacts that prove themselves (echo.io): each Parquet output records its contract (columns
and types) in its footer and a CRC32 per page; every reader checks both, and a truncated, damaged
or schema-altered file fails naming the file, what is wrong and the rule to re-run."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from echo import artifacts
from echo.errors import ArtifactError
from echo.io import CONTRACT_KEY, read_parquet, rule_hint, write_parquet
from echo.simulate.stage import load_kernels
from echo.workflow.status import damaged

CONTRACTS = {name: value for name, value in vars(artifacts).items() if isinstance(value, pa.Schema)}


def kernels_table(n: int = 2000) -> pa.Table:
    rows = [dict(kernel_key=f"aten.mm.default[{i},{i + 1}]bf16", name="aten.mm.default", op_class="gemm",
                 shapes=f"[[{i}, {i + 1}]]", dtype="bfloat16", flops=float(i), bytes=2.0 * i, duration_us=1.0 + i,
                 achieved_tflops=0.5, achieved_GBps=10.0, source="model", count=i % 7) for i in range(n)]
    return pa.Table.from_pylist(rows, artifacts.KERNELS)


@pytest.fixture
def kernels_file(tmp_path: Path) -> Path:
    path = tmp_path / "results" / "profile" / "w" / "h100" / "kernels.parquet"
    write_parquet(kernels_table(), path, artifacts.KERNELS)
    return path


@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_every_contract_round_trips_and_is_recorded(tmp_path: Path, name: str) -> None:
    schema = CONTRACTS[name]
    path = tmp_path / f"{name}.parquet"
    write_parquet(schema.empty_table(), path, schema)
    assert pq.ParquetFile(path).schema_arrow.metadata[CONTRACT_KEY]
    assert read_parquet(path, schema).schema.equals(schema)


def test_a_good_file_reads_back_identical(kernels_file: Path) -> None:
    assert read_parquet(kernels_file, artifacts.KERNELS).equals(kernels_table())
    assert load_kernels(kernels_file)["aten.mm.default[3,4]bf16"] == 4.0


@pytest.mark.parametrize("keep", [0, 3, 100, 0.5, -9])
def test_a_truncated_file_names_itself_and_its_rule(kernels_file: Path, keep: float) -> None:
    data = kernels_file.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(data) + keep)
    kernels_file.write_bytes(data[:cut])
    with pytest.raises(ArtifactError, match=r"kernels\.parquet: not a readable Parquet file .*"
                                            r"snakemake --forcerun profile"):
        load_kernels(kernels_file)


def test_every_flipped_bit_in_the_data_pages_is_caught(kernels_file: Path) -> None:
    data = kernels_file.read_bytes()
    footer = int.from_bytes(data[-8:-4], "little") + 8
    rng = random.Random(7)
    for _ in range(60):
        damaged_bytes = bytearray(data)
        i = rng.randrange(4, len(data) - footer)
        damaged_bytes[i] ^= 1 << rng.randrange(8)
        kernels_file.write_bytes(bytes(damaged_bytes))
        with pytest.raises(ArtifactError, match="kernels.parquet: .*snakemake --forcerun profile"):
            read_parquet(kernels_file, artifacts.KERNELS)


def test_a_flipped_bit_in_the_footer_never_gives_other_content(kernels_file: Path) -> None:
    """Footer flips that land in statistics or padding read back the same table; every other is
    caught (Thrift structure, the recorded contract): none yields different rows or columns."""
    data, want = kernels_file.read_bytes(), kernels_table()
    footer = int.from_bytes(data[-8:-4], "little")
    rng, caught = random.Random(11), 0
    for _ in range(150):
        damaged_bytes = bytearray(data)
        damaged_bytes[rng.randrange(len(data) - 8 - footer, len(data) - 8)] ^= 1 << rng.randrange(8)
        kernels_file.write_bytes(bytes(damaged_bytes))
        try:
            got = read_parquet(kernels_file, artifacts.KERNELS)
        except ArtifactError:
            caught += 1
            continue
        assert got.equals(want)
    assert caught > 0


def test_schema_altered_files_say_what_changed(kernels_file: Path) -> None:
    table = pq.read_table(kernels_file)  # with its recorded contract in the metadata
    pq.write_table(table.drop_columns(["duration_us"]), kernels_file)
    with pytest.raises(ArtifactError, match=r"does not match its recorded contract: lacks columns \['duration_us'\]"):
        read_parquet(kernels_file)
    cast = table.set_column(table.schema.get_field_index("count"), "count", table["count"].cast(pa.float64()))
    pq.write_table(cast, kernels_file)
    with pytest.raises(ArtifactError, match="count is double, not int64"):
        load_kernels(kernels_file)
    pq.write_table(table.replace_schema_metadata(None), kernels_file)  # another tool's file
    with pytest.raises(ArtifactError, match="records no Echo contract"):
        read_parquet(kernels_file)


def test_a_reader_checks_its_own_contract_too(tmp_path: Path) -> None:
    path = tmp_path / "results" / "trace" / "w" / "ranks.parquet"
    write_parquet(pa.table({"rank": pa.array([0], pa.int32())}), path)  # self-consistent, not TRACED_RANKS
    assert read_parquet(path).num_rows == 1
    with pytest.raises(ArtifactError, match=r"does not match the contract its reader expects: lacks columns "
                                            r"\['role'.*snakemake --forcerun trace"):
        read_parquet(path, artifacts.TRACED_RANKS)


def test_rule_hints_follow_the_results_folders() -> None:
    assert rule_hint("results/simulate/w/h/t/summary.parquet").endswith("snakemake --forcerun simulate (or delete the file)")
    assert "snakemake --forcerun dedup" in rule_hint("/x/results/dedup/w/rank_classes.parquet")
    assert "--summary" in rule_hint("/tmp/elsewhere/table.parquet")


def test_status_lists_damaged_artifacts_with_their_rule(tmp_path: Path, kernels_file: Path) -> None:
    good = tmp_path / "results" / "dedup" / "w" / "rank_classes.parquet"
    write_parquet(artifacts.RANK_CLASSES.empty_table(), good, artifacts.RANK_CLASSES)
    kernels_file.write_bytes(kernels_file.read_bytes()[:-20])
    rows = [{"output_file": str(p.relative_to(tmp_path)), "rule": rule, "status": "ok"}
            for p, rule in ((good, "dedup"), (kernels_file, "profile"))]
    rows.append({"output_file": "results/simulate/w/h/t/summary.parquet", "rule": "simulate"})  # not made yet
    assert [line.split(":")[0] for line in damaged(rows, tmp_path)] == [rows[1]["output_file"]]
    assert damaged(rows, tmp_path)[0].endswith("snakemake --forcerun profile")


def test_a_missing_file_stays_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_parquet(tmp_path / "absent.parquet")
