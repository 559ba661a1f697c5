"""Layout: per-request values leave the static prefix for the end of the prompt, and nothing the model needs is lost."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.errors import ConfigError, DynamicPatternError
from prefixgate.proxy import layout as layout_module
from prefixgate.proxy.layout import (
    BLOCK_INTRO,
    DEFAULT_PATTERNS,
    DynamicPattern,
    LaidOut,
    MovedValue,
    describe,
    find_dynamic,
    lay_out,
)

UUID = "123e4567-e89b-12d3-a456-426614174000"


def chat(system: str, *turns: tuple[str, Any]) -> list[dict[str, Any]]:
    """Return a system message followed by (role, content) turns; a single user question by default."""
    return [{"role": "system", "content": system}] + [
        {"role": role, "content": content} for role, content in (turns or (("user", "What day is it?"),))
    ]


def found(text: str) -> list[tuple[str, str]]:
    """Return (pattern, value) for each default match in `text`."""
    return [(match.pattern, match.value) for match in find_dynamic(text)]


MATCHES: list[tuple[str, str, str]] = [
    ("Now: 2026-11-29T14:05:33Z.", "datetime", "2026-11-29T14:05:33Z"),
    ("Now: 2026-11-29T14:05:33.120+01:00", "datetime", "2026-11-29T14:05:33.120+01:00"),
    ("Now: 2026-11-29 14:05", "datetime", "2026-11-29 14:05"),
    ("Built 20261129T140533Z", "datetime", "20261129T140533Z"),
    ("Today is 2026-11-29.", "date", "2026-11-29"),
    ("Today is November 29, 2026.", "date", "November 29, 2026"),
    ("Today is Nov. 29th 2026", "date", "Nov. 29th 2026"),
    ("Today is 29 Nov 2026", "date", "29 Nov 2026"),
    ("Today is Sunday, 29 November 2026.", "date", "Sunday, 29 November 2026"),
    ("Today is Sunday, the 29th of November 2026", "date", "Sunday, the 29th of November 2026"),
    ("Today is Sunday, November 29.", "date", "Sunday, November 29"),
    ("Today is 2026/11/29", "date", "2026/11/29"),
    ("Today is 11/29/2026", "date", "11/29/2026"),
    ("Heute ist 29.11.2026.", "date", "29.11.2026"),
    ("It is 14:05.", "time", "14:05"),
    ("It is 14:05:33 now", "time", "14:05:33"),
    ("It is 2:05 PM", "time", "2:05 PM"),
    ("It is 2:05 p.m. here", "time", "2:05 p.m."),
    ("It is 14:05 UTC", "time", "14:05 UTC"),
    (f"Session {UUID}.", "uuid", UUID),
    (f"Session {UUID.upper()}", "uuid", UUID.upper()),
    ("request id: abc123", "request_id", "abc123"),
    ("request_id=8f3a9c0d", "request_id", "8f3a9c0d"),
    ("X-Request-ID: 'f00ba7'", "request_id", "f00ba7"),
    ("The trace id is 4bf92f3577b34da6.", "request_id", "4bf92f3577b34da6"),
    ("Served by req_8f3a91c2.", "request_id", "req_8f3a91c2"),
    ("Reply to chatcmpl-9x8Y7z6W", "request_id", "chatcmpl-9x8Y7z6W"),
    ("timestamp: 1764400000", "timestamp", "1764400000"),
    ("request_ts=1764400000123", "timestamp", "1764400000123"),
    ('"now": 1764400000.25.', "timestamp", "1764400000.25"),
]

NOT_MATCHED = [
    "Use Python 3.11.7 or newer.",
    "It costs $14.05, or 1,234.56 in total.",
    "There are 1764400000 stars.",
    "Use a 16:9 aspect ratio.",
    "Connect to localhost:8080 or 10.0.0.1:8080.",
    "The request id is optional.",
    "Set req_timeout to 30.",
    "Knowledge cutoff: December 2023.",
    "Ship it by May 5 at the latest.",
    "Release 2024.11.29 is current.",
    "Call 555-123-4567.",
    "Answer in 3 to 5 sentences, in 2026 style.",
    "Timestamps look like this: timestamp: <value>.",
    "Pages 1/2 and 3/4.",
]


@pytest.mark.parametrize(("text", "pattern", "value"), MATCHES, ids=[row[2] for row in MATCHES])
def test_each_default_pattern_finds_its_value_once(text: str, pattern: str, value: str) -> None:
    assert found(text) == [(pattern, value)]


@pytest.mark.parametrize("text", NOT_MATCHED)
def test_ordinary_numbers_versions_and_prices_are_not_dynamic(text: str) -> None:
    assert found(text) == []


def test_a_datetime_is_not_also_counted_as_a_date_and_a_time() -> None:
    assert found("At 2026-11-29T14:05:33+01:00 and again on November 29, 2026 at 2:05 PM.") == [
        ("datetime", "2026-11-29T14:05:33+01:00"),
        ("date", "November 29, 2026"),
        ("time", "2:05 PM"),
    ]


def test_the_longest_of_overlapping_matches_wins() -> None:
    patterns = (DynamicPattern("short", r"ab"), DynamicPattern("long", r"bcd"), DynamicPattern("tail", r"de"))
    assert [(m.pattern, m.start, m.end) for m in find_dynamic("abcde", patterns)] == [("long", 1, 4)]


def test_a_long_text_scanned_before_gives_the_values_of_this_text_by_these_patterns() -> None:
    rules = " ".join(f"Rule {i}: reply within {i % 9 + 1} days." for i in range(200))  # past the remembered length
    today, tomorrow = f"{rules} Today is 2026-11-29.", f"{rules} Today is 2026-11-30."
    assert len(today) >= layout_module._REMEMBERED_CHARACTERS
    first = find_dynamic(today)
    assert [(m.pattern, m.value) for m in first] == [("date", "2026-11-29")]
    assert find_dynamic(today) == first  # remembered: the same values
    assert [m.value for m in find_dynamic(tomorrow)] == ["2026-11-30"]  # another text, scanned afresh
    assert find_dynamic(today, (DynamicPattern("rule", r"Rule \d+"),))[0].value == "Rule 0"  # other patterns too
    first.clear()  # a caller's list is its own
    assert find_dynamic(today) != first


def test_a_long_text_full_of_values_is_not_remembered() -> None:
    dates = " ".join(f"2026-{month:02d}-{day:02d}" for month in range(1, 13) for day in range(1, 29))  # 336 dates
    assert len(dates) >= layout_module._REMEMBERED_CHARACTERS and layout_module._REMEMBERED_VALUES < 336
    layout_module._FOUND.clear()
    assert len(find_dynamic(dates)) == 336
    assert not layout_module._FOUND


def test_lay_out_replaces_values_with_numbered_placeholders_and_appends_them() -> None:
    system = f"Today is 2026-11-29, it is 14:05. Yesterday was 2026-11-28. Session {UUID}."
    laid = lay_out(chat(system))
    assert laid.messages[0]["content"] == "Today is [date 1], it is [time 1]. Yesterday was [date 2]. Session [uuid 1]."
    assert laid.messages[1]["content"] == (
        "What day is it?\n\n"
        f"{BLOCK_INTRO}[date 1] = 2026-11-29; [time 1] = 14:05; [date 2] = 2026-11-28; [uuid 1] = {UUID})"
    )
    assert laid.moved == (
        MovedValue("date", "2026-11-29", 0, 9),
        MovedValue("time", "14:05", 0, 27),
        MovedValue("date", "2026-11-28", 0, 48),
        MovedValue("uuid", UUID, 0, 68),
    )


def test_moved_offsets_point_into_the_original_content() -> None:
    messages = chat(f"request id: abc123. Date 2026-11-29 at 9:30. timestamp: 1764400000 {UUID}")
    laid = lay_out(messages)
    assert len(laid.moved) == 5
    for value in laid.moved:
        original = messages[value.message]["content"]
        assert original[value.start : value.start + len(value.value)] == value.value


def test_every_moved_value_is_still_visible_to_the_model_in_the_final_message() -> None:
    laid = lay_out(chat("Now 2026-11-29T14:05:33Z; req_8f3a91c2; timestamp=1764400000; Sunday, 29 November 2026"))
    final = laid.messages[-1]["content"]
    assert len(laid.moved) == 4
    for value in laid.moved:
        assert value.value not in laid.messages[0]["content"]
        assert f"[{value.pattern} 1] = {value.value}" in final


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("Today is 2026-11-29.", "Today is 2027-01-03."),
        ("Now: 2026-11-29T14:05:33Z", "Now: 2026-11-29T14:06:01.5+02:00"),
        (f"Session {UUID}", "Session 9b2d6c1e-0f4a-4c8e-9a7b-3d2e1f0a9b8c"),
        ("request_id=abc123 at 14:05", "request_id=zz9f0e1 at 9:41"),
        ("Today is Sunday, November 29, 2026.", "Today is Monday, December 7, 2026."),
    ],
)
def test_prompts_differing_only_in_dynamic_values_get_identical_system_messages(first: str, second: str) -> None:
    a, b = lay_out(chat(first)), lay_out(chat(second))
    assert a.messages[0] == b.messages[0]
    assert a.messages[-1] != b.messages[-1]


def test_developer_messages_are_static_too_and_numbering_continues_across_the_request() -> None:
    messages = [
        {"role": "developer", "content": "Date: 2026-11-29"},
        {"role": "user", "content": "Is 2026-11-30 a holiday?"},
        {"role": "system", "content": "Deadline: 2026-12-01"},
        {"role": "user", "content": "And 2026-12-24?"},
    ]
    laid = lay_out(messages)
    assert [m["content"] for m in laid.messages[:3]] == [
        "Date: [date 1]",
        "Is 2026-11-30 a holiday?",
        "Deadline: [date 2]",
    ]
    assert (
        laid.messages[3]["content"] == f"And 2026-12-24?\n\n{BLOCK_INTRO}[date 1] = 2026-11-29; [date 2] = 2026-12-01)"
    )
    assert describe(laid.moved) == "date@0:6,date@2:10"


def test_user_assistant_and_tool_messages_are_never_altered_except_the_appended_block() -> None:
    messages = chat(
        "Today is 2026-11-29.",
        ("user", "Book 2026-12-01 at 14:05, id req_8f3a91c2."),
        ("assistant", "Booked for 2026-12-01."),
        ("user", "And cancel 2026-12-02?"),
        ("assistant", None),
        ("tool", '{"cancelled": "2026-12-02T10:00:00Z"}'),
    )
    laid = lay_out(messages)
    assert laid.messages[1:3] == messages[1:3]
    assert laid.messages[4:] == messages[4:]
    assert laid.messages[3]["content"] == f"And cancel 2026-12-02?\n\n{BLOCK_INTRO}[date 1] = 2026-11-29)"


def test_without_a_user_message_the_block_goes_to_the_last_message() -> None:
    laid = lay_out([{"role": "system", "content": "At 14:05."}, {"role": "assistant", "content": "Hi"}])
    assert laid.messages[1]["content"] == f"Hi\n\n{BLOCK_INTRO}[time 1] = 14:05)"


def test_a_system_only_request_keeps_the_values_at_its_end() -> None:
    laid = lay_out([{"role": "system", "content": "At 14:05."}])
    assert laid.messages[0]["content"] == f"At [time 1].\n\n{BLOCK_INTRO}[time 1] = 14:05)"


def test_a_user_message_made_of_parts_gets_the_block_as_one_more_text_part() -> None:
    parts = [{"type": "text", "text": "Hi"}]
    laid = lay_out(chat("At 14:05.", ("user", parts)))
    assert laid.messages[1]["content"] == [*parts, {"type": "text", "text": f"{BLOCK_INTRO}[time 1] = 14:05)"}]


def test_no_match_returns_the_same_content_in_a_new_list() -> None:
    messages = chat("You are helpful. Use Python 3.11.7.")
    laid = lay_out(messages)
    assert laid.messages == messages and laid.messages is not messages
    assert laid.moved == ()
    assert describe(laid.moved) == ""


def test_layout_with_no_patterns_is_the_identity() -> None:
    messages = chat(f"Today is 2026-11-29, session {UUID}.")
    laid = lay_out(messages, patterns=())
    assert laid.messages == messages
    assert laid.moved == ()


def test_lay_out_leaves_its_input_untouched() -> None:
    messages = chat("Today is 2026-11-29.", ("user", [{"type": "text", "text": "Hi"}]))
    before = copy.deepcopy(messages)
    lay_out(messages)
    assert messages == before


def test_custom_patterns_move_only_their_value_group() -> None:
    patterns = (DynamicPattern("build", r"build (?P<value>\d+)"), DynamicPattern("user", r"@\w+"))
    laid = lay_out(chat("You run build 4711 for @alice."), patterns)
    assert laid.messages[0]["content"] == "You run build [build 1] for [user 1]."
    assert laid.moved == (MovedValue("build", "4711", 0, 14), MovedValue("user", "@alice", 0, 23))


def test_find_dynamic_explains_a_changing_tool_description() -> None:
    description = "Search the catalog as of 2026-11-29 14:05 UTC."
    assert [(m.pattern, m.start, m.end) for m in find_dynamic(description)] == [("datetime", 25, 45)]


def test_describe_is_one_ascii_line_and_counts_what_it_leaves_out() -> None:
    moved = [MovedValue("date", "2026-11-29", 0, 27), MovedValue("uuid", UUID, 0, 88), MovedValue("time", "1:00", 2, 5)]
    assert describe(moved) == "date@0:27,uuid@0:88,time@2:5"
    assert describe(moved, limit=1) == "date@0:27,+2"
    assert describe(moved).isascii() and "\n" not in describe(moved)


def test_a_regex_that_does_not_compile_names_the_pattern() -> None:
    with pytest.raises(DynamicPatternError, match=r"dynamic pattern 'order_id' does not compile: .*fix its regex"):
        DynamicPattern("order_id", r"order-(\d+")


@pytest.mark.parametrize(
    ("name", "regex", "message"),
    [("", r"x", "must start with a letter"), ("order id", r"x", "must start with a letter"), ("any", r"\d*", "empty")],
)
def test_a_bad_pattern_setting_is_a_config_error(name: str, regex: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        DynamicPattern(name, regex)
    assert isinstance(info.value, ValueError)


def test_default_patterns_have_plain_names() -> None:
    assert {pattern.name for pattern in DEFAULT_PATTERNS} == {
        "datetime",
        "date",
        "time",
        "uuid",
        "request_id",
        "timestamp",
    }


def restored(laid: LaidOut, index: int = 0) -> str:
    """Return message `index` of a layout with each placeholder put back as the value it stands for."""
    content: str = laid.messages[index]["content"]
    counts: dict[str, int] = {}
    pieces = []
    position = 0
    for value in (moved for moved in laid.moved if moved.message == index):
        counts[value.pattern] = counts.get(value.pattern, 0) + 1
        placeholder = f"[{value.pattern} {counts[value.pattern]}]"
        found_at = content.index(placeholder, position)
        pieces += [content[position:found_at], value.value]
        position = found_at + len(placeholder)
    return "".join(pieces) + content[position:]


MEGABYTE = 1_000_000

# The patterns' worst cases, and their relatives: each a long run that a pattern scans, with a value or without one.
WORST_CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("a label and a megabyte of spaces", "request id" + " " * MEGABYTE, []),
    (
        "a label, a megabyte of spaces, then its value",
        "request id" + " " * MEGABYTE + "abc123",
        [("request_id", "abc123")],
    ),
    ("a label, tabs and newlines, a colon", "request id" + " \t\n" * (MEGABYTE // 3) + ":", []),
    ("labels chained in one token", "request_id:" * (MEGABYTE // 11), []),
    ("labels chained with hyphens", "request-id-" * (MEGABYTE // 11), []),
    ("a weekday and a megabyte of spaces", "Sunday," + " " * MEGABYTE + "the", []),
    ("a timestamp label and spaces", "timestamp" + " " * MEGABYTE + "=", []),
]


@pytest.mark.parametrize(("text", "values"), [row[1:] for row in WORST_CASES], ids=[row[0] for row in WORST_CASES])
def test_the_worst_cases_for_the_patterns_keep_their_meaning(text: str, values: list[tuple[str, str]]) -> None:
    laid = lay_out(chat(text))
    assert [(moved.pattern, moved.value) for moved in laid.moved] == values
    assert restored(laid) == text


def test_thousands_of_dates_each_move_and_put_back_give_the_original() -> None:
    days = [f"{2000 + i // 336}-{i // 28 % 12 + 1:02d}-{i % 28 + 1:02d}" for i in range(8000)]
    system = "Deadlines: " + " ".join(days)
    laid = lay_out(chat(system))
    assert [moved.value for moved in laid.moved] == days
    assert laid.messages[0]["content"] == "Deadlines: " + " ".join(f"[date {i}]" for i in range(1, 8001))
    assert restored(laid) == system
    assert laid.messages[1]["content"].endswith(f"[date 8000] = {days[-1]})")


def test_thousands_of_overlapping_matches_keep_only_the_longest() -> None:
    text = " ".join(f"2026-11-{i % 28 + 1:02d}T14:{i % 60:02d}" for i in range(8000))  # each a date and a time too
    matches = find_dynamic(text)
    assert len(matches) == 8000 and {match.pattern for match in matches} == {"datetime"}


def test_a_labeled_id_of_up_to_128_characters_moves_and_a_longer_run_stays() -> None:
    longest = "a1" * 64
    assert found(f"request id: {longest}.") == [("request_id", longest)]
    assert found(f"request id: {longest}b.") == []


FRAGMENTS = [" ", "\t", "\n", ":", "=", "-", "_", ".", "'", "a", "7", "é", "is", "id", "request", "req_", "trace id"]
FRAGMENTS += ["2026-11-29", "T14:05", "14:05", " PM", "Sunday, ", "May", " 5", "29th of ", "ts=", "1764400000", UUID]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join))
def test_putting_the_moved_values_back_gives_the_original_text(system: str) -> None:
    laid = lay_out(chat(system))
    assert restored(laid) == system
    assert all(value.value and not value.value.isspace() for value in laid.moved)
