"""Errors that cross ranks travel as data (RankError) and come back as the same typed error."""

import pickle

import pytest

from partita.errors import (KINDS, CheckpointError, InternalError, PartitaError, PlanError, RankError, as_partita,
                            first_error)


class _UsersCheckpointError(CheckpointError):
    pass


def test_a_partita_error_keeps_its_kind_and_message():
    sent = RankError.of(3, PlanError("no plan fits"))
    assert sent == RankError(3, "PlanError", "no plan fits")
    error = sent.error()
    assert type(error) is PlanError and str(error) == "rank 3: no plan fits"


def test_any_other_exception_becomes_a_partita_error_naming_its_type():
    sent = RankError.of(1, ValueError("bad value"))
    assert sent == RankError(1, "PartitaError", "ValueError: bad value")
    error = sent.error()
    assert type(error) is PartitaError and str(error) == "rank 1: ValueError: bad value"


def test_a_subclass_defined_elsewhere_travels_as_its_nearest_partita_kind():
    sent = RankError.of(0, _UsersCheckpointError("damaged"))
    assert sent.kind == "CheckpointError" and type(sent.error()) is CheckpointError


def test_internal_error_is_a_kind():
    assert issubclass(InternalError, PartitaError) and "InternalError" in KINDS
    assert type(RankError.of(0, InternalError("x")).error()) is InternalError


def test_unknown_kind_becomes_a_partita_error():
    error = RankError(2, "NoSuchError", "odd").error()
    assert type(error) is PartitaError and str(error) == "rank 2: odd"


def test_messages_unnamed_and_with_what_failed():
    sent = RankError.of(1, RuntimeError("injected fault"))
    assert str(sent.error(named=False)) == "RuntimeError: injected fault"
    assert str(sent.error(failed_while="measuring the blocks")) == (
        "rank 1 failed while measuring the blocks: RuntimeError: injected fault")
    assert str(sent.error(named=False, failed_while="measuring the blocks")) == (
        "failed while measuring the blocks: RuntimeError: injected fault")


def test_it_is_plain_data():
    sent = RankError.of(0, PlanError("p"))
    assert pickle.loads(pickle.dumps(sent)) == sent
    with pytest.raises(AttributeError):
        sent.rank = 1  # frozen
    assert sent.cause == ("PlanError", "p") == RankError.of(5, PlanError("p")).cause


def test_as_partita():
    own = PlanError("p")
    assert as_partita(own) is own
    other = as_partita(KeyError("k"))
    assert type(other) is PartitaError and str(other) == "KeyError: 'k'"


def test_first_error_names_the_lowest_failing_rank():
    errors = [None, RankError.of(2, PlanError("b")), RankError.of(1, PlanError("a")), None]
    error = first_error(errors, world=4)
    assert type(error) is PlanError and str(error) == "rank 1: a"
    assert first_error([None, None], world=2) is None


def test_first_error_is_unnamed_when_every_rank_failed_alike():
    alike = [RankError.of(r, PlanError("same")) for r in range(3)]
    assert str(first_error(alike, world=3)) == "same"
    assert str(first_error(alike[:2], world=3)) == "rank 0: same"  # one rank did not fail
    differ = alike[:2] + [RankError.of(2, PlanError("other"))]
    assert str(first_error(differ, world=3)) == "rank 0: same"
    assert str(first_error(differ, world=3, failed_while="planning")) == "rank 0 failed while planning: same"


def test_an_error_whose_text_starts_on_a_new_line_shows_the_error_it_came_from():
    # torch's PipelineStage wraps a stage's error so: RuntimeError(f"\n  [Stage 1] failed to run forward: ...") from e
    try:
        try:
            raise ValueError("index 7 is out of range")
        except ValueError as e:
            raise RuntimeError("\n            [Stage 1] failed to run forward:\n            args: ('T(f32)',)\n") from e
    except RuntimeError as wrapped:
        sent = RankError.of(1, wrapped)
    assert str(sent.error()) == ("rank 1: RuntimeError: [Stage 1] failed to run forward:, from ValueError: index 7 is "
                                 "out of range")
    assert str(as_partita(RuntimeError("\n"))) == "RuntimeError: \n"  # nothing it came from: as it is
