"""Per-tenant shares of DRAM and SSD: how much each tenant holds and whom eviction spares.

A tenant is an ACL user given a quota (``quota-dram=64mb``, ``quota-ssd=1gb``:
kvstore/admin/acl.py). It gets a small id, 1 to MAX_TENANTS, kept for its
name for the life of the process; every value records the id of the tenant
that wrote it in the entry table's one-byte owner column, and the entry table
keeps the value bytes per tenant per tier beside its bytes per tier, on the
same add/remove/resize/move paths (kvstore/store/entries.py), so a put costs
one more store and nothing here walks the keys. Id 0 (SHARED) is the shared
pool: the default user and every user without a quota write there, with no
share and no protection.

A quota is a share, not a cap: free memory is anyone's, and quotas only decide
who loses when something must go. Whom a choice spares, pass by pass
(`passes`, read by kvstore/store/room.py and `Engine.coldest`):

- a writer whose write takes it over its own quota may take only its own
  values (every other tenant is spared); if none of them can go, the write
  fails with Redis's OOM error rather than cost anyone else a value;
- any other choice first takes only values of tenants over their quota, then
  anything but tenants at or below their quota (a quiet tenant within its
  share is never evicted, or demoted, for another tenant's write).

Quotas count value bytes, as INFO's per-tier bytes do; a value is counted in
the tier that is its home (a DRAM value with a clean SSD copy counts in DRAM).
A quota is refused when it, or the sum of every tenant's quota of that tier,
exceeds the tier's size (DRAM's: the maxmemory in force, and CONFIG SET
maxmemory refuses a limit under the sum): then every tenant can reach its
share at once.

Across a restart: a value written to SSD carries its tenant's name in its
record (kvstore/tiers/record.py, `label`), and a warm restart gives each name
found there its id again (`named`), before or after the user's quota is set
once more, so a tenant's SSD values count against its share from the start. A
value a slot move pushes to another node carries the name the same way
(KV.IMPORT, kvstore/commands/cluster_data.py).
"""
from __future__ import annotations

from kvstore.store.entries import DRAM, OWNERS, SSD, TIERS

SHARED = 0
MAX_TENANTS = OWNERS - 1     # ids fit the entry table's one-byte owner column
MAX_NAME_BYTES = 255         # a tenant's name as an SSD record stores it
NO_QUOTA = -1
QUOTA_TIERS = {"dram": DRAM, "ssd": SSD}


class QuotaError(ValueError):
    """A quota the node cannot honour; the message says why."""


class Quotas:
    """Tenant ids by name, each tenant's quota per tier, and the bytes it holds (``used``,
    the entry table's ``tenant_bytes``). ``capacity``: bytes per tier a quota must fit in
    (0 for a tier the node does not have)."""

    def __init__(self, used: list[list[int]], capacity: list[int]):
        self.used = used
        self.capacity = capacity
        self.names = ["(shared)"]                   # tenant id -> user name
        self.ids: dict[str, int] = {}
        self.quota = [[NO_QUOTA] for _ in TIERS]    # tier -> tenant id -> bytes or NO_QUOTA
        self.active = [False] * len(TIERS)          # whether any tenant has a quota in the tier

    def tenant(self, name: str) -> int:
        """The id of tenant ``name`` (SHARED when it never had a quota)."""
        return self.ids.get(name, SHARED)

    def label(self, tenant: int) -> bytes | None:
        """What an SSD record stores of tenant id ``tenant``: its name's bytes (None: the shared pool)."""
        return _name_bytes(self.names[tenant]) if tenant else None

    def named(self, label: bytes | None) -> int:
        """The id of the tenant a `label` names (an SSD record's at a warm restart, a value
        another node pushes here): the name's id, given now when it has none yet (its quota may
        be set later: its bytes are counted already); SHARED for the shared pool, a name longer
        than a quota's user may have, or when every id is taken."""
        if label is None or len(label) > MAX_NAME_BYTES:
            return SHARED
        name = label.decode(errors="surrogateescape")
        tenant = self.ids.get(name)
        if tenant is None:
            if len(self.names) > MAX_TENANTS:
                return SHARED
            tenant = self._add(name)
        return tenant

    def _add(self, name: str) -> int:
        """A new tenant id for ``name``, with no quota yet."""
        tenant = self.ids[name] = len(self.names)
        self.names.append(name)
        for column in self.quota:
            column.append(NO_QUOTA)
        return tenant

    # ------------------------------------------------------------ setting quotas

    def check(self, wanted: dict[str, dict[int, int]]) -> None:
        """Raise QuotaError unless ``wanted`` (every tenant's quotas after a change: name ->
        tier -> bytes) fits the node; nothing changes either way."""
        new_names = [name for name in wanted if name not in self.ids]
        if len(self.names) - 1 + len(new_names) > MAX_TENANTS:
            raise QuotaError(f"no more than {MAX_TENANTS} users can have quotas on a node")
        for name in new_names:
            if len(_name_bytes(name)) > MAX_NAME_BYTES:
                raise QuotaError(f"a user with a quota has a name of at most {MAX_NAME_BYTES} bytes")
        for word, tier in QUOTA_TIERS.items():
            size = self.capacity[tier]
            total = 0
            for name, quotas in wanted.items():
                quota = quotas.get(tier)
                if quota is None:
                    continue
                if not size:
                    raise QuotaError(f"quota-{word} for '{name}': this node has no {word.upper()} tier")
                if quota > size:
                    raise QuotaError(f"quota-{word} for '{name}' is {quota} bytes, more than the node's "
                                     f"{word.upper()} ({size} bytes)")
                total += quota
            if total > size:
                raise QuotaError(f"the {word.upper()} quotas would add up to {total} bytes, more than the "
                                 f"node's {word.upper()} ({size} bytes)")

    def apply(self, wanted: dict[str, dict[int, int]]) -> None:
        """Make ``wanted`` (checked) the quotas: named tenants get theirs, all others none.
        A tenant keeps its id after losing its quota (its values still carry it)."""
        self.check(wanted)
        for name in wanted:
            if name not in self.ids:
                self._add(name)
        for tier, column in enumerate(self.quota):
            for tenant, name in enumerate(self.names):
                column[tenant] = wanted.get(name, {}).get(tier, NO_QUOTA)
            self.active[tier] = any(quota != NO_QUOTA for quota in column)

    def total(self, tier: int) -> int:
        """The sum of every tenant's quota of ``tier``: the least that tier may be cut to."""
        return sum(quota for quota in self.quota[tier] if quota != NO_QUOTA)

    # ------------------------------------------------------------ eviction

    def passes(self, tier: int, writer: int = SHARED, size: int = 0) -> list[bytes | None]:
        """Whom each pass of a choice in ``tier`` spares (module doc), for a write of ``size``
        bytes by ``writer`` (SHARED for a move nobody's write asked for): per pass, a byte per
        tenant id, 1 for spared; None spares nobody."""
        if not self.active[tier]:
            return [None]
        quota, used = self.quota[tier], self.used[tier]
        if quota[writer] != NO_QUOTA and used[writer] + size > quota[writer]:
            return [bytes(tenant != writer for tenant in range(len(quota)))]
        over = [limit != NO_QUOTA and used[tenant] > limit for tenant, limit in enumerate(quota)]
        within = bytes(limit != NO_QUOTA and used[tenant] <= limit and tenant != writer
                       for tenant, limit in enumerate(quota))
        last = within if any(within) else None
        return [bytes(not o for o in over), last] if any(over) else [last]

    # ------------------------------------------------------------ reporting

    def report(self) -> list[tuple[str, list[int], list[int]]]:
        """(name, bytes per tier, quota per tier or NO_QUOTA) of every tenant, shared pool first."""
        return [(name, [self.used[tier][tenant] for tier in TIERS], [self.quota[tier][tenant] for tier in TIERS])
                for tenant, name in enumerate(self.names)]


def _name_bytes(name: str) -> bytes:
    """A user name's bytes as they arrived (names are decoded with surrogateescape)."""
    return name.encode(errors="surrogateescape")
