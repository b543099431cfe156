"""A job takes as many of a worker's slots as it has sequences: one larger than every worker of its model is
refused at the edge, naming the limit (separate edge, simulated worker and Redis processes)."""

from __future__ import annotations

import httpx

from tests.stack import Stack


async def test_a_request_with_more_sequences_than_a_worker_has_slots_is_refused(stack: Stack) -> None:
    edge = stack.edge()
    stack.worker(max_num_seqs=4)
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        fits = await client.post("/v1/completions", json={"model": stack.model, "prompt": ["a", "b"], "n": 2,
                                                          "max_tokens": 2})
        too_wide = await client.post("/v1/completions", json={"model": stack.model, "prompt": ["a", "b"], "n": 3,
                                                               "max_tokens": 2})
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 4, fits.text
    assert too_wide.status_code == 400, too_wide.text
    error = too_wide.json()["error"]
    assert error["code"] == "too_many_sequences" and error["param"] == "prompt", error
    assert "6 sequences" in error["message"] and "(4, its max_num_seqs)" in error["message"], error
