"""`jaxgrad audit`: the command the README shows."""

import json

from jaxgrad.cli import main


def test_audit_of_the_packages_ops_passes_and_writes_json(capsys, tmp_path):
    out = tmp_path / "audit.json"
    assert main(["audit", "--op", "swiglu[xla]", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "audit: swiglu[xla]" in text and "VERDICT: PASS" in text and "one optimizer step" in text
    data = json.loads(out.read_text())
    assert data[0]["passed"] is True and len(data[0]["reports"]) == 3


def test_planted_catalogue_is_classified(capsys):
    assert main(["audit", "--planted", "--op", "linear/"]) == 0
    text = capsys.readouterr().out
    assert "linear/bias-grad-mean" in text and "3/3 classified correctly" in text


def test_unknown_op_is_an_error(capsys):
    assert main(["audit", "--op", "no-such-op"]) == 2
    assert "no op matches" in capsys.readouterr().err
