"""eaglet.workflow.summary's total: the span of the last invocation of the workflow, not of every job whose
record the run keeps (a target built in an earlier session made the total hours long); the sampled
temperatures' τ from the results matrix."""

from eaglet.workflow.summary import IDLE_S, _walls, sampled_parts


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


def test_sampled_temperatures_are_read_from_the_results_matrix():
    def row(engine, t, k, tau, ci, set_name="all", domain="all"):
        return {"engine": engine, "temperature": t, "k": k, "set": set_name, "domain": domain, "tau": tau,
                "ci": ci, "prompts": 4}

    matrix = [row("chain", 0.0, 3, 1.3, [1.2, 1.4]), row("expected", 1.0, 3, 1.25, [1.2, 1.31]),
              row("hf_loop", 1.0, 3, 1.22, None), row("hf_loop", 1.0, 2, 1.1, None),
              row("hf_loop", 1.0, 3, 1.9, None, domain="math"), row("vllm", 0.7, 3, None, None)]
    assert sampled_parts(matrix, 3) == ["at T=0.7 τ(k=3) with 95% CI: vLLM n/a",
                                        "at T=1 τ(k=3) with 95% CI: expected offline 1.25 [1.20, 1.31], "
                                        "HF loop 1.22 (no interval)"]
    assert sampled_parts(matrix[:1], 3) == []
