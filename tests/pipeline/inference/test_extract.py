from pipeline.inference.extract import (
    check_citations,
    cited_pages,
    missing_fields,
    pages_in_text,
    parse_json_output,
)


def test_bare_object():
    r = parse_json_output('{"title": "Q3 report", "total": 1250}')
    assert r.ok and r.value == {"title": "Q3 report", "total": 1250}


def test_code_fence_with_prose_around():
    text = 'Sure! Here is the data:\n```json\n{"author": "Ada", "pages": [1, 2]}\n```\nHope this helps.'
    r = parse_json_output(text)
    assert r.value == {"author": "Ada", "pages": [1, 2]}


def test_fence_wins_over_braces_in_prose():
    text = 'The set {a, b} is not JSON.\n```\n{"x": 1}\n```'
    assert parse_json_output(text).value == {"x": 1}


def test_trailing_text_after_object():
    r = parse_json_output('{"date": "2024-03-01"} and then the model kept talking {')
    assert r.value == {"date": "2024-03-01"}


def test_leading_garbage_brace_then_valid_object():
    r = parse_json_output('I think { maybe } ... final: {"ok": true}')
    assert r.value == {"ok": True}


def test_array_answer():
    assert parse_json_output("answer: [1, 2, 3]").value == [1, 2, 3]


def test_invalid_json_gives_parse_error_with_position():
    r = parse_json_output('{"title": "unterminated, "total": 3')
    assert not r.ok and r.value is None
    assert "invalid JSON" in r.error and "char" in r.error


def test_no_json_at_all():
    r = parse_json_output("The author is Ada Lovelace.")
    assert r.error == "no JSON object or array in the model output"


def test_scalar_not_accepted():
    assert not parse_json_output("42").ok


def test_missing_fields():
    assert missing_fields({"title": 1}, ["title", "author"]) == ["author"]
    assert missing_fields([1], ["title"]) == ["title"]
    assert missing_fields({"a": 1}, None) == []


def test_cited_pages_from_keys_and_markers():
    value = {
        "total": {"value": 1250, "page": 3},
        "author": {"value": "Ada", "pages": [1, "2"]},
        "note": "see [Page 7] and [page 3]",
    }
    assert cited_pages(value) == [3, 1, 2, 7]


def test_pages_in_text():
    assert pages_in_text("as stated on page 4 and [Page 12]") == [4, 12]
    assert pages_in_text("nothing here") == []


def test_check_citations_flags_unknown_pages():
    assert check_citations([1, 3], [1, 2, 3]) == {"cited": [1, 3], "unknown": [], "valid": True}
    bad = check_citations([2, 40], [1, 2, 3])
    assert bad["unknown"] == [40] and bad["valid"] is False
