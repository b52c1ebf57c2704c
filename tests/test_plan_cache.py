"""``commlab plan`` measures a machine once and keeps it (commlab.plan.cache): kept, reused, measured again
when the key it was kept under changes, when asked (``--recalibrate``) and when the file is unreadable.
Every test points the cache folder at its own tmp_path ($XDG_CACHE_HOME): nothing is written to the real home."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commlab.plan import cache as KC
from commlab.plan.__main__ import main as plan_main
from commlab.plan.costmodel import Bucket, Calibration, Compute

# the tiny model, one regime, one N, one compressor: what is measured takes well under a second
ARGS = ["--model", "tiny", "--batch-size", "8", "--workers", "8", "--regimes", "ring://", "--max-shards", "2",
        "--compress", "fp16"]
MEASURED_ALL = ["compute and server costs", "compressors fp16"]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "commlab"


def plan(tmp_path: Path, name: str, *extra: str) -> dict:
    """One ``commlab plan`` call; its plan.json's ``calibration`` (what it measured, where it is kept)."""
    out = tmp_path / name
    assert plan_main([*ARGS, *extra, "--out", str(out)]) == 0
    return json.loads((out / "plan.json").read_text())["calibration"]


def test_plan_keeps_what_it_measured_reuses_it_and_measures_again_when_asked_or_unreadable(tmp_path, cache, capsys):
    first = plan(tmp_path, "a")
    kept = Path(first["kept"])
    assert kept.parent == cache and kept.exists() and first["measured_now"] == MEASURED_ALL
    doc = json.loads(kept.read_text())
    assert doc["key"]["query"] == {"model": "tiny", "batch": 8, "input_shape": None}
    assert doc["calibration"]["transports"] == {} and set(doc["calibration"]["compressors"]) == {"fp16"}
    capsys.readouterr()
    second = plan(tmp_path, "b")  # the second call calibrates nothing
    assert second["measured_now"] == [] and second["kept"] == first["kept"]
    assert second["measured_utc"] == first["measured_utc"]  # the kept figures, not new ones
    assert "commlab plan: measured nothing: " in capsys.readouterr().err
    kept.write_text('{"key": {"format": 1, "query"')  # a write cut short
    third = plan(tmp_path, "c")
    err = capsys.readouterr().err
    assert third["measured_now"] == MEASURED_ALL
    assert f"commlab plan: {kept} is not a calibration this commlab can read (JSONDecodeError" in err
    assert "measuring again, and replacing it" in err and json.loads(kept.read_text())["key"] == doc["key"]
    # --recalibrate measures everything again; a compressor the file lacked is measured and kept beside fp16
    fourth = plan(tmp_path, "d", "--recalibrate", "--compress", "fp16", "sign")
    assert fourth["measured_now"] == ["compute and server costs", "compressors fp16, sign"]
    assert set(json.loads(kept.read_text())["calibration"]["compressors"]) == {"fp16", "sign"}


def calibration() -> Calibration:
    return Calibration({}, 1e-10, 2e-10, Compute("m", 8, 1e-4, 2e-4, (Bucket(400, 1.0, (("w", (10, 10), "float32"),)),),
                                                (("w", (10, 10), "float32"),)), {"measured_utc": "then", "run_dir": None})


def test_a_file_kept_under_another_key_is_not_used_and_the_reason_names_what_changed(cache):
    kept = KC.Kept.of("m", 8)
    assert kept.path.parent == cache and kept.load()[0] is None and "does not exist" in kept.load()[1]
    kept.save(calibration())
    assert kept.load() == (calibration(), "")
    doc = json.loads(kept.path.read_text())
    for part, field, value in (("versions", "torch", "0.0"), ("machine", "cores", 999), ("versions", "git", "abc")):
        changed = json.loads(json.dumps(doc))
        changed["key"][part][field] = value
        kept.path.write_text(json.dumps(changed))
        cal, why = kept.load()
        assert cal is None and f"{part}.{field}: {value!r} -> {doc['key'][part][field]!r}" in why
    assert KC.Kept.of("m", 16).path != kept.path and KC.Kept.of("m", 8, (1, 8, 8)).path != kept.path


@pytest.mark.parametrize("content", ["{cut sho", '{"key": [1], "calibration": {}}', '{"key": {}}', "[]",
                                     '{"key": %s}'])
def test_an_unreadable_cache_file_is_reported_not_crashed_on(cache, content):
    kept = KC.Kept.of("m", 8)
    kept.save(calibration())
    kept.path.write_text(content.replace("%s", json.dumps(kept.key)))  # the last: the right key, no calibration
    cal, why = kept.load()
    assert cal is None and why.startswith(f"{kept.path} ") and why.endswith("measuring again, and replacing it")


def test_recalibrate_with_a_calibration_file_is_one_line_naming_the_option(tmp_path, cache, capsys):
    assert plan_main(["--calibration", str(tmp_path / "x.json"), "--recalibrate", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("commlab plan: --recalibrate: ") and len(err.splitlines()) == 1


def answer(tmp_path: Path, name: str, *extra: str) -> tuple[dict, str]:
    """One ``commlab plan`` call: its plan.json, and plan.md after the line naming the command."""
    out = tmp_path / name
    assert plan_main([*ARGS, "--workers", "8,64", "--regimes", "ring://", "ps://?shards=2&mode=async", *extra,
                      "--out", str(out)]) == 0
    return json.loads((out / "plan.json").read_text()), "\n".join((out / "plan.md").read_text().splitlines()[3:])


ANSWER = ("workers", "regimes", "batch", "results", "crossovers", "compression", "seconds")


def test_a_repeated_query_is_answered_from_the_cache_exactly_as_simulating_it_again(tmp_path, cache, capsys):
    first, first_md = answer(tmp_path, "a", "--save-calibration", str(tmp_path / "cal.json"))
    assert first["kept_answer"] is None and list(cache.glob("plan-answers/*/plan.json"))
    capsys.readouterr()
    second, second_md = answer(tmp_path, "b")  # nothing measured, nothing simulated
    err = capsys.readouterr().err
    assert second["kept_answer"] and Path(second["kept_answer"]).parent == cache / "plan-answers"
    assert "commlab plan: measured nothing: " in err and "simulated nothing: " in err
    assert second["calibration"]["measured_now"] == [] and (tmp_path / "b" / "plan.png").exists()
    # the oracle: the same calibration simulated now (--calibration FILE never reads or keeps an answer)
    fresh, fresh_md = answer(tmp_path, "c", "--calibration", str(tmp_path / "cal.json"))
    assert fresh["kept_answer"] is None and fresh["results"] and fresh["compression"]["by_workers"]
    assert {k: second[k] for k in ANSWER if k != "seconds"} == {k: fresh[k] for k in ANSWER if k != "seconds"}
    assert {k: second[k] for k in ANSWER} == {k: first[k] for k in ANSWER} and second_md == first_md == fresh_md
    # another option is another query; an edited planner another answer
    assert answer(tmp_path, "d", "--seed", "1")[0]["kept_answer"] is None
    assert answer(tmp_path, "e", "--seed", "1")[0]["kept_answer"]
    assert answer(tmp_path, "f", "--recalibrate")[0]["kept_answer"] is None
    assert KC.PLANNER_SOURCES and all((Path(KC.commlab.__file__).parent / p).exists() for p in KC.PLANNER_SOURCES)


def test_a_kept_answer_that_cannot_be_read_is_answered_again(tmp_path, cache):
    answer(tmp_path, "a")
    for kept in cache.glob("plan-answers/*/plan.json"):
        kept.write_text('{"cut')
    again, _ = answer(tmp_path, "b")
    assert again["kept_answer"] is None and again["results"]
    assert answer(tmp_path, "c")[0]["kept_answer"]
