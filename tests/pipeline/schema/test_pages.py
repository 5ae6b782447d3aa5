"""Page-range syntax and resolution (pipeline.schema.pages)."""

import pytest

from pipeline.errors import PageRangeError
from pipeline.schema.pages import LAST, parse_page_ranges, select_pages


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("7", [(7, 7)]),
        ("1-20,35,-5", [(1, 20), (35, 35), (-5, -5)]),
        (" 3 - 9 , 12- ", [(3, 9), (12, LAST)]),
        ("-5--1", [(-5, -1)]),
        ("1--2", [(1, -2)]),
        ("-3-", [(-3, LAST)]),
    ],
)
def test_parse(spec, expected):
    assert parse_page_ranges(spec) == expected


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("1-x", "cannot parse '1-x'"),
        ("1,,2", "cannot parse ''"),
        ("--5", "cannot parse"),
        ("1-2-3", "cannot parse"),
        ("0", "start at 1"),
        ("0-4", "start at 1"),
        ("9-3", "reversed"),
        ("-1--5", "reversed"),
        ("a", "cannot parse"),
    ],
)
def test_parse_errors(spec, fragment):
    with pytest.raises(PageRangeError) as e:
        parse_page_ranges(spec)
    assert fragment in str(e.value)
    assert repr(spec) in str(e.value)  # the message quotes the whole spec


@pytest.mark.parametrize(
    "spec, count, expected",
    [
        (None, 4, [1, 2, 3, 4]),
        ("1-20,35,-5", 40, list(range(1, 21)) + [35, 36]),
        ("-1", 10, [10]),
        ("-5", 10, [6]),  # ONE page: the fifth from the end
        ("-5--1", 10, [6, 7, 8, 9, 10]),
        ("8-", 10, [8, 9, 10]),
        ("1--2", 4, [1, 2, 3]),
        ("5,1-3,2", 6, [1, 2, 3, 5]),  # sorted and de-duplicated
        ("-3-", 5, [3, 4, 5]),
        ("3-3", 3, [3]),
    ],
)
def test_select(spec, count, expected):
    assert select_pages(spec, count) == expected


@pytest.mark.parametrize(
    "spec, count, fragment",
    [
        ("1-20", 12, "page 20 is out of range: the document has 12 page(s)"),
        ("13", 12, "page 13 is out of range"),
        ("-13", 12, "page -13 is out of range"),
        ("5--3", 6, "reversed"),  # resolves to 5-4
        ("4-", 3, "page 4 is out of range"),
    ],
)
def test_select_errors_name_document(spec, count, fragment):
    with pytest.raises(PageRangeError) as e:
        select_pages(spec, count, document="inbox/report.pdf")
    msg = str(e.value)
    assert msg.startswith("inbox/report.pdf: ")
    assert fragment in msg
    assert e.value.document == "inbox/report.pdf"


def test_page_range_error_is_value_error():
    # pydantic validators and generic callers can catch it as a ValueError
    with pytest.raises(ValueError):
        select_pages("x", 3)
