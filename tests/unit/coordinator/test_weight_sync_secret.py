"""Every epoch of a job's weight-sync group has its own random secret, and only a member's
GetWeightSyncGroup answer carries it."""

from __future__ import annotations

from services.coordinator.weight_sync_groups import WeightSyncGroups


def test_every_epoch_gets_a_fresh_secret_that_every_member_of_it_shares() -> None:
    groups = WeightSyncGroups("127.0.0.1", port_fn=lambda host: 1234)
    groups.open("job", "gloo")
    trainer, _ = groups.get("job", "trainer")
    rollout, _ = groups.get("job", "rollout")
    assert len(trainer.secret) == 64 and rollout.secret == trainer.secret

    seen = {trainer.secret}
    for change in (
        lambda: groups.get("job", "rollout-b"),  # a replica joins
        lambda: groups.get("job", "trainer", failed_epoch=groups.get("job", "trainer")[0].epoch),  # a failure
        lambda: groups.set_replicas("job", ["rollout"]),
        lambda: groups.reform("job"),
    ):
        change()
        current, _ = groups.get("job", "trainer")
        assert current.secret not in seen and len(current.secret) == 64
        seen.add(current.secret)
    assert len(seen) == 5

    other = WeightSyncGroups("127.0.0.1", port_fn=lambda host: 1234)
    other.open("job", "gloo")
    assert other.get("job", "trainer")[0].secret not in seen  # random, not derived from job and epoch


def test_answers_other_than_a_members_get_carry_no_secret() -> None:
    groups = WeightSyncGroups("127.0.0.1", port_fn=lambda host: 1234)
    groups.open("job", "gloo")
    groups.get("job", "rollout-b")
    assert groups.leave("job", "rollout-b").secret == ""
    assert groups.set_replicas("job", ["rollout", "rollout-c"]).secret == ""
    assert groups.reform("job").secret == ""
    assert groups.get("job", "rollout-c")[0].secret != ""
