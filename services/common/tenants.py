"""Tenants as the API-keys file names them: each key's tenant, and each tenant's store quota.

The file (`--api-keys-file`, read by the Conductor and by `mooncake up`) has one key per line::

    # KEY        [TENANT]  [dram=SIZE] [ssd=SIZE]
    sk-team-a    team-a    dram=1GiB   ssd=4GiB
    sk-team-a-2  team-a
    sk-public

The tenant salts that key's KV blocks (tenants never share a prefix); `dram=`/`ssd=` set the
tenant's share of the store (`mooncake store master --tenant-quota`), on any one of its lines
(two lines giving a tenant different quotas is an error). Sizes take B, KiB, MiB, GiB, TiB (and
KB, MB, GB, TB). Here, apart from the store, so that the Conductor, `mooncake up` and the store
master read one format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40,
          "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """`1GiB`, `512MiB`, `1g`, `4096` -> bytes; ValueError naming the text otherwise."""
    s = text.strip().lower().replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if not num or unit not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number with an optional unit "
                         "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"size {text!r}: {num!r} is not a number") from None
    if value < 0:
        raise ValueError(f"size {text!r} is negative")
    return int(value * _UNITS[unit])


QuotaPair = tuple[int | None, int | None]
"""(DRAM bytes, SSD bytes); None = unlimited in that tier."""


@dataclass
class ApiKeys:
    """What an API-keys file says: each key's tenant, and the tenants' quotas."""

    tenants: dict[str, str] = field(default_factory=dict)
    """key -> tenant ("" = the shared tenant)."""
    quotas: dict[str, QuotaPair] = field(default_factory=dict)
    """tenant -> its store quota, for the tenants the file gives one."""

    def quota_flags(self) -> list[str]:
        """The master's `--tenant-quota NAME=DRAM,SSD` arguments for these quotas."""
        out: list[str] = []
        for tenant, (dram, ssd) in sorted(self.quotas.items()):
            sizes = f"{'-' if dram is None else dram},{'-' if ssd is None else ssd}"
            out += ["--tenant-quota", f"{tenant}={sizes}"]
        return out


def read_api_keys(path: str) -> ApiKeys:
    """Parse an API-keys file (module docstring); ValueError naming the file and line."""
    out = ApiKeys()
    where: dict[str, int] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            parts = line.split("#", 1)[0].split()
            if not parts:
                continue
            names = [p for p in parts if "=" not in p]
            attrs = [p for p in parts if "=" in p]
            if len(names) > 2 or parts[: len(names)] != names:
                raise ValueError(f"{path}:{n}: expected 'KEY [TENANT] [dram=SIZE] [ssd=SIZE]'")
            key, tenant = names[0], names[1] if len(names) == 2 else ""
            out.tenants[key] = tenant
            if attrs:
                quota = _quota(path, n, tenant, attrs)
                old = out.quotas.get(tenant)
                if old is not None and old != quota:
                    raise ValueError(f"{path}:{n}: tenant {tenant!r} has another quota on line "
                                     f"{where[tenant]}")
                out.quotas[tenant] = quota
                where[tenant] = n
    if not out.tenants:
        raise ValueError(f"{path}: no API keys in the file")
    return out


def _quota(path: str, n: int, tenant: str, attrs: list[str]) -> QuotaPair:
    if not tenant:
        raise ValueError(f"{path}:{n}: a quota (dram=, ssd=) needs a TENANT after the key")
    sizes: dict[str, int] = {}
    for attr in attrs:
        name, _, value = attr.partition("=")
        if name not in ("dram", "ssd"):
            raise ValueError(f"{path}:{n}: unknown attribute {name!r} (dram=SIZE, ssd=SIZE)")
        if name in sizes:
            raise ValueError(f"{path}:{n}: {name}= given twice")
        try:
            sizes[name] = parse_size(value)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {name}=: {e}") from None
    return sizes.get("dram"), sizes.get("ssd")
