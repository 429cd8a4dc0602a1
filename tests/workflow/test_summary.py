"""eaglet.workflow.summary's total: the span of the last invocation of the workflow, not of every job whose
record the run keeps (a target built in an earlier session made the total hours long)."""

from eaglet.workflow.summary import IDLE_S, _walls


def _job(rule, start, end):
    return {"rule": rule, "start": start, "end": end, "seconds": end - start}


def test_total_spans_the_last_invocation_only():
    t0 = 1_000_000.0
    jobs = [_job("target_model", t0 - 6 * 3600, t0 - 6 * 3600 + 33),  # kept from hours before
            _job("prompts", t0, t0 + 4), _job("extract_hidden_states", t0 + 4, t0 + 340),
            _job("token_freq", t0 + 5, t0 + 9),  # ran beside extraction
            _job("train", t0 + 340, t0 + 860)]
    walls, total = _walls({"stage_wall_times": jobs})
    assert total == 860 and walls["target"] == 33 and walls["extract"] == 336
    # the same target built just before, in the same invocation, is part of it
    jobs[0] = _job("target_model", t0 - 30, t0 - 1)
    assert _walls({"stage_wall_times": jobs})[1] == 890
    # a pause longer than IDLE_S between jobs starts a new invocation
    jobs.append(_job("evaluate_offline", t0 + 860 + IDLE_S + 1, t0 + 860 + IDLE_S + 61))
    assert _walls({"stage_wall_times": jobs})[1] == 60
    assert _walls({}) == ({}, None)
