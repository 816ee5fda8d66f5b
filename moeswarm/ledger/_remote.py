"""``RemoteJudge``: a backbone's audit judge that asks the ledger service to re-execute a sample."""

from __future__ import annotations

import aiohttp

from moeswarm.errors import BadResponse, NetworkError, Unreachable

from ._audit import AuditSample, AuditVerdict


class RemoteJudge:
    """``POST {url}/v1/audits``: the ledger re-executes with its own weights and keeps the evidence.

    The ledger trusts nothing in the sample but the two signatures: the hashes in the receipt bind
    the hidden rows, the routing and the outputs, so a backbone cannot frame an honest server."""

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def __call__(self, sample: AuditSample) -> AuditVerdict:
        try:
            async with aiohttp.ClientSession(timeout=self.timeout) as session, session.post(
                    f"{self.url}/v1/audits", data=sample.encode(),
                    headers={"Content-Type": "application/msgpack"}) as resp:
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise Unreachable(f"ledger at {self.url}: {e}") from None
        if resp.status == 422:
            raise BadResponse(f"the ledger refused the audit sample: {body.get('error')}")
        if resp.status != 200:
            raise NetworkError(f"the ledger could not audit ({resp.status}): {body.get('error')}")
        return AuditVerdict.from_json(body)
