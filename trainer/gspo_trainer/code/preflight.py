"""Before anything starts: the sandbox runs a program here, and every row has usable tests.

A row without tests, or with malformed ones, is an error naming the row and the field now,
rather than a run that scores it as a sandbox failure at every step.
"""

from __future__ import annotations

from gspo_api.spec import GSPOJobSpec

Problem = tuple[str, str]  # (field path, message)


def uses_code(spec: GSPOJobSpec) -> bool:
    return spec.reward.scores_code()


def check_code_reward(spec: GSPOJobSpec) -> list[Problem]:
    """The sandbox (reward.sandbox) and each row's tests (reward.code), when code is scored."""
    if not uses_code(spec):
        return []
    from gspo_trainer.code.runner import build_code_scorer
    from gspo_trainer.code.tasks import BadTests, task_from_row
    from gspo_trainer.data import load_eval_examples, load_examples

    try:
        # Not waiting for the job's sandbox pods: they start with the learner, which waits
        # for them once its status server serves (Kueue's WaitForPodsReady counts on it).
        build_code_scorer(spec.reward.code, spec.reward.sandbox, wait=False)
    except ValueError as exc:  # "reward.sandbox.<field> ...: why; the fix"
        field, _, why = str(exc).removeprefix("reward.sandbox.").partition(" ")
        return [(f"spec.reward.sandbox.{field.rstrip(':')}", why)]
    sets = [("spec.data.source", lambda: load_examples(spec.data))]
    if spec.data.eval_source:
        sets.append(("spec.data.evalSource", lambda: load_eval_examples(spec.data) or []))
    for where, load in sets:
        try:
            examples = load()
        except (ValueError, OSError):
            return []  # check_data says what is wrong with the data itself
        for i, example in enumerate(examples):
            try:
                task_from_row(example.row, spec.reward.code)
            except BadTests as exc:
                return [(where, f"row {i}: {exc} (reward.kind code needs tests in every row)")]
    return []
