"""The redaction engine: recall and precision on the labelled corpus at or above their
measured floors, the forms issue #28 found missed or over-redacted, no hand-picked
near-miss false positives, idempotence, linear time on pathological megabytes, safe
tenant patterns."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.errors import BadRequest, NotFound
from sluice.pii.redaction import find, redact
from sluice.pii.safe_patterns import UnsafePattern, compile_tenant_pattern
from tests.sluice.redaction_corpus import NEGATIVES, Sample, positives, score

POSITIVES = positives()


@pytest.mark.parametrize("sample", POSITIVES, ids=[f"{s.label}-{i}"
                                                    for i, s in enumerate(POSITIVES)])
def test_every_valid_identifier_is_redacted(sample: Sample) -> None:
    out = redact(sample.text)
    assert sample.secret not in out
    assert f"[{sample.label}]" in out, out


@pytest.mark.parametrize("text", NEGATIVES)
def test_near_misses_are_left_alone(text: str) -> None:
    assert redact(text) == text


def test_placeholders_keep_the_surrounding_text() -> None:
    text = ("Card 4111 1111 1111 1111, mail jane@example.com, call +1 415 555 2671, "
            "SSN 123-45-6789; Authorization: Bearer abc123def456ghi789")
    assert redact(text) == ("Card [CARD], mail [EMAIL], call [PHONE], SSN [SSN]; "
                            "Authorization: Bearer [TOKEN]")


@pytest.mark.parametrize("sample", POSITIVES[::7])
def test_redaction_is_idempotent_on_the_corpus(sample: Sample) -> None:
    once = redact(sample.text)
    assert redact(once) == once


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=30),
                          st.sampled_from([s.secret for s in POSITIVES])), max_size=8))
def test_redaction_is_idempotent_on_mixtures(parts: list[str]) -> None:
    text = " ".join(parts)
    once = redact(text)
    assert redact(once) == once
    for part in parts:
        if any(part == s.secret for s in POSITIVES):
            assert part not in once or redact(part) == part


PATHOLOGICAL = {
    "digits": "1" * 64, "spaced digits": "1 " * 32, "dashed": "4111-" * 16,
    "at signs": "a@" * 32, "dots": "a." * 32, "jwt starts": "eyJ" * 20 + ".",
    "iban starts": "DE89 " * 12, "plus": "+1 " * 20, "colons": "::" * 30,
    "hex": "ab:" * 20, "bearer": "Bearer " * 10, "sk": "sk-" * 20, "letters": "a" * 64,
    "dotted digits": "4111." * 16, "glued ssns": "x536-42-7151" * 6,
    "ssn labels": "SSN: " * 12 + "536427151 ", "phone words": "call me at " * 6 + "4155552671 ",
    "placeholders": "[SSN]-" * 12 + "1", "bare numbers": "2147483647 " * 6,
}


@pytest.mark.parametrize("name", list(PATHOLOGICAL))
def test_linear_time_on_a_megabyte(name: str) -> None:
    unit = PATHOLOGICAL[name]

    def timed(size: int) -> float:
        text = (unit * (size // len(unit) + 1))[:size]
        started = time.perf_counter()
        redact(text)
        return time.perf_counter() - started

    small, big = timed(256 * 1024), timed(1024 * 1024)
    assert big < 15.0, f"{name}: {big:.1f} s for 1 MB"
    assert big < 4 * small * 2 + 0.5, f"{name}: {small:.2f} s -> {big:.2f} s (not linear)"


def test_tenant_patterns_are_applied_and_checked() -> None:
    pattern = compile_tenant_pattern(r"EMP-\d{6}")
    assert redact("employee EMP-123456 left", [("EMPLOYEE_ID", pattern)]) == \
        "employee [EMPLOYEE_ID] left"
    for unsafe in [r"(a+)+b", r"(a|aa)*c", r"(\w+)\1", r"(?=x)x", r"x*", "", "a" * 201,
                   r"([a-z]*)*", r"(unclosed"]:
        with pytest.raises(UnsafePattern):
            compile_tenant_pattern(unsafe)
    assert isinstance(compile_tenant_pattern(r"[A-Z]{3}-\d+"), re.Pattern)


# -- issue #28: forms it missed, and what it over-redacted ------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ("ssn-536-42-7151", "ssn-[SSN]"),
    ("x536-42-7151", "x[SSN]"),
    ("536-42-7151x", "[SSN]x"),
    ("ssn_536 42 7151 on file", "ssn_[SSN] on file"),
])
def test_an_ssn_touching_a_word_is_redacted(text: str, expected: str) -> None:
    assert redact(text) == expected


@pytest.mark.parametrize("text", [
    "SSN 536427151", "social security number: 536427151", "SSN number 536427151",
    "Social Security #: 536427151", "SSN (536427151)", '"ssn": "536427151"',
    "<ssn>536427151</ssn>", "SocialSecurityNumber=536427151", "ssn-536427151",
    "SSN on file: 536427151", "536427151 is my SSN", "536427151 (SSN)",
    "my ss number 536427151",
])
def test_a_bare_nine_digit_number_is_redacted_where_the_text_says_ssn(text: str) -> None:
    out = redact(text)
    assert "536427151" not in out and "[SSN]" in out, out


@pytest.mark.parametrize("text", [
    "order 536427151 shipped", "SSN verified, order 536427151 shipped",
    "assn 536427151", "[SSN] 536427151", "1-536-42-7151", "536-42-7151-0001",
])
def test_a_bare_or_embedded_nine_digit_number_without_an_ssn_label_stays(text: str) -> None:
    assert redact(text) == text


@pytest.mark.parametrize("text", [
    "4111.1111.1111.1111", "4111 1111 1111 1111", "4111-1111-1111-1111",
    "4111111111111111", "3782.822463.10005", "card-4111.1111.1111.1111"])
def test_cards_are_redacted_with_dots_spaces_or_dashes(text: str) -> None:
    out = redact(f"pay with {text} today")
    assert out.startswith("pay with ") and "[CARD]" in out and "1111" not in out, out


@pytest.mark.parametrize("text", [
    "4111.1111.1111.1112", "4111.1111-1111 1111", "4 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1",
    "1.4111.1111.1111.1111"])
def test_card_shaped_numbers_that_fail_luhn_or_grouping_stay(text: str) -> None:
    assert redact(text) == text


@pytest.mark.parametrize("text", [
    "No such file: 'file-2881cb411111111111df4697'.",  # a Maestro-valid run in an id
    "file-4111111111111111abcdef12", "digest 0a9f4111111111111111",
    "trace 4bf92f3577b34da6a3ce929d0e0e4736 span 00f067aa0ba902b7",
    "request 550e8400-e29b-41d4-a716-501800000002"])
def test_a_luhn_valid_run_inside_a_hex_identifier_is_not_a_card(text: str) -> None:
    assert redact(text) == text


def test_a_card_beside_a_short_word_or_hex_letters_is_still_redacted() -> None:
    for text in ("cc4111111111111111", "card:4111111111111111 abc", "4111111111111111abc",
                 "id 4111 1111 1111 1111 abcdef"):
        assert "[CARD]" in redact(text), text


@pytest.mark.parametrize("text", [
    "max_tokens is 2147483647; this model's context is 2048 tokens.",
    "user id 4155552671", "order #4155552671", "PO 4500012345", "seed=2125550199",
    "account 0123456789", "id 2147483647 - call failed"])
def test_a_bare_integer_is_not_a_phone_number(text: str) -> None:
    assert redact(text) == text


def test_an_error_message_keeps_the_number_it_quotes() -> None:
    # given the error every protocol encodes when max_tokens is out of range
    error = BadRequest("max_tokens is 2147483647; this model's context is 2048 tokens.",
                       param="max_tokens")
    # when it is rendered for the caller (REST, SSE, WebSocket and gRPC all use body())
    message = error.body()["error"]["message"]
    # then the number is still there
    assert message == "max_tokens is 2147483647; this model's context is 2048 tokens."


@pytest.mark.parametrize("text", [
    "+14155552671", "+1 415 555 2671", "(415) 555-2671", "415-555-2671", "415.555.2671",
    "1-415-555-2671", "020 7946 0958", "phone: 4155552671", "call me at 14155552671",
    "Tel.:4155552671", "mobile 07911123456", "4155552671 (mobile)",
    "reach me on 4155552671"])
def test_phone_numbers_with_a_format_or_a_phone_word_are_redacted(text: str) -> None:
    out = redact(text)
    assert "[PHONE]" in out and "555" not in out and "791" not in out, out


# -- issue #41: a bare number typed on its own, an unassigned area code, "(at)" ---------
def test_a_model_not_found_message_loses_a_bare_ssn_or_phone_it_quotes() -> None:
    # given the error a call to an unknown model gets, quoting what the caller typed
    for model, placeholder in [("123456789", "[SSN]"), ("5551234567", "[PHONE]"),
                               ("15551234567", "[PHONE]")]:
        error = NotFound(f"The model '{model}' does not exist or you do not have access "
                         "to it.", code="model_not_found", param="model")
        # when it is rendered for the caller and the audit log
        message = error.body()["error"]["message"]
        # then the number is gone, the rest stays
        assert message == (f"The model '{placeholder}' does not exist or you do not have "
                           "access to it."), message


@pytest.mark.parametrize("text", [
    "'536427151x'", "'000123456'", "'123004567'", '"customer_id": "536427151"',
    "customer_id='536427151'", "{'536427151': 3}", "'1234567890'", "'0123456789'",
    '{"user_id": "4155552671"}', "'41555526712'", "order 5551234567 shipped",
    "555-123-4567", "'123456789"])
def test_a_quoted_number_that_is_not_alone_or_not_ssn_or_phone_shaped_stays(
        text: str) -> None:
    assert redact(text) == text


@pytest.mark.parametrize("text", [
    "call me at 5551234567", "phone: (555) 123-4567", "555-123-4567 (mobile)"])
def test_a_phone_word_makes_an_unassigned_area_code_a_phone_number(text: str) -> None:
    out = redact(text)
    assert "[PHONE]" in out and "4567" not in out, out


@pytest.mark.parametrize(("text", "expected"), [
    ("mail jane(at)example.com now", "mail [EMAIL] now"),
    ("mail jane [at] example.co.uk.", "mail [EMAIL]."),
    ("mail jane{AT}corp-mail.io", "mail [EMAIL]"),
    ("mail jane.doe at example.com", "mail [EMAIL]"),
    ("mail j_smith AT example.org", "mail [EMAIL]"),
])
def test_an_email_with_its_at_spelled_out_is_redacted(text: str, expected: str) -> None:
    assert redact(text) == expected
    assert redact(expected) == expected


@pytest.mark.parametrize("text", [
    "look at example.com", "e.g. at example.com", "Python 3.12 at python.org",
    "name at example dot com", "jane at example", "user (at) localhost"])
def test_prose_with_at_before_a_domain_stays(text: str) -> None:
    assert redact(text) == text


def test_redaction_is_idempotent_next_to_other_identifiers() -> None:
    # given identifiers glued to each other and to labels (what a second pass sees
    # differently: placeholders where digits and letters were)
    texts = ["4111111111111111-536-42-7151", "x@example.org.536-42-7151x4111.1111.1111.1111",
             "fe80::1ff:fe23:4567:890a..305-533-8984", "1-415-555-2671::assn 123456789",
             "AKIAFO7BP5EKOMEBCCEGcell 16179523937", "ssn: 506-29-6739.-818995471",
             "first.last@mail.example.co.uk.bearer bonds+484603427",
             "iban: BA36 5329 2259 3546 6525.[027 12 7185 306321365"]
    for text in texts:
        # when redacted twice, then the second pass changes nothing
        once = redact(text)
        assert redact(once) == once, (text, once)


def test_recall_and_precision_on_the_corpus_hold_their_floors() -> None:
    # given the labelled corpus (positives incl. the forms issue #28 found missed;
    # negatives: large integers, token counts, ids, timestamps, versions, dates, prices,
    # hashes, UUIDs, order numbers, near misses)
    scores = score(find)
    # then recall and precision are at or above what docs/AUDIT.md reports (measured:
    # recall 100%, precision 99.6%: two random 16-digit integers pass Luhn and a card
    # issuer's prefix, which no rule can tell from a card)
    assert scores.recall() >= 0.995, [m.text for m in scores.misses]
    assert scores.precision() >= 0.99, scores.flagged
    for label in scores.tp:
        assert scores.recall(label) >= 0.98, (label, scores.misses)
        assert scores.precision(label) >= 0.95, (label, scores.flagged)
    for form, total in scores.forms.items():
        assert scores.forms_hit[form] == total, (form, scores.misses)
    for category, total in scores.negatives.items():
        assert scores.negatives_flagged[category] <= 0.02 * total, (category, scores.flagged)
