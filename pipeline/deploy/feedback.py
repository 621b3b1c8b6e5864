"""Feedback on served answers: the body of ``POST /feedback`` checked and turned into a capture record.

A caller sends ``{"request_id": "<id of an answer>", "rating"?: 1-5, "label"?: "success" | "failure", "text"?:
"..."}`` (a rating, a label or both; text at most ``capture.feedback_max_chars``). The id must name a request this
capture folder holds (404 otherwise): feedback is appended to the capture segments as a ``feedback`` record
(:mod:`pipeline.deploy.capture`), redacted like every record. Feedback needs capture on (409 otherwise). A caller may
send feedback on one request more than once; the last one counts. How feedback becomes a label of the reward model:
:mod:`pipeline.core.traffic`.
"""

from __future__ import annotations

import math

from pipeline.core.traffic import utc_now

LABELS = ("success", "failure")
RATING_MIN, RATING_MAX = 1, 5
FIELDS = ("request_id", "rating", "label", "text")


class FeedbackError(ValueError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def feedback_record(obj, known: set, max_chars: int) -> dict:
    """The ``feedback`` record of a request body, or a FeedbackError (422 for a bad field, 404 for an unknown id)."""
    if not isinstance(obj, dict):
        raise FeedbackError(422, "feedback must be a JSON object {request_id, rating?, label?, text?}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise FeedbackError(422, f"unknown fields {unknown}; allowed: {list(FIELDS)}")
    rid, rating, label, text = (obj.get(k) for k in FIELDS)
    if not isinstance(rid, str) or not rid:
        raise FeedbackError(422, "field 'request_id' is required: the request_id of an answer of POST /solve")
    if rating is None and label is None:
        raise FeedbackError(422, "give field 'rating' (1-5) or field 'label' ('success' or 'failure'), or both")
    if rating is not None and (isinstance(rating, bool) or not isinstance(rating, (int, float))
                               or not math.isfinite(rating) or not RATING_MIN <= rating <= RATING_MAX):
        raise FeedbackError(422, f"field 'rating': must be a number from {RATING_MIN} to {RATING_MAX}")
    if label is not None and label not in LABELS:
        raise FeedbackError(422, f"field 'label': must be one of {list(LABELS)}")
    if text is not None and (not isinstance(text, str) or len(text) > max_chars):
        raise FeedbackError(422, f"field 'text': must be a string of at most {max_chars} characters "
                                 f"(deploy.serve.capture.feedback_max_chars)")
    if rid not in known:
        raise FeedbackError(404, f"unknown request_id {rid[:80]!r}: no captured answer has it")
    return {"kind": "feedback", "request_id": rid, "time": utc_now(), "rating": rating, "label": label, "text": text}


__all__ = ["FeedbackError", "LABELS", "feedback_record"]
