"""The receipt ledger: dual-signed receipts of served expert-FLOPs, hash-chained in SQL, settled per
epoch into signed statements with Merkle roots, spot-checked by audits.

    from moeswarm.ledger import Ledger, StoreConfig, LedgerService, ReceiptSubmitter

    ledger = Ledger(StoreConfig("ledger.db", create=True), identity)   # or a PostgreSQL URL
    results = ledger.ingest([countersigned, ...])                      # after the commit
    statement = settle_epoch(ledger, epoch)                            # signed, with a Merkle root
    report = verify_chain(ledger)                                      # every link and signature

Settled roots go into the swarm's DHT (``publish_root``), where volunteers check proofs against
them (``fetch_root``, ``root_problem``). A backbone submits through ``ReceiptSubmitter(url, queue_dir)`` (its receipt sink) to a
``LedgerService`` (``moeswarm-ledger serve``). See ``cli.py`` for the command line.
"""

from ._accounts import GrantRecord, Standing
from ._audit import (
    AuditConfig,
    AuditRunner,
    AuditSample,
    AuditVerdict,
    check_sample,
    reexecute,
)
from ._chain import GENESIS_HASH, ModelShape, Reason, entry_hash, receipt_id
from ._errors import DatabaseMissing, LedgerCorrupt
from ._evidence import EvidenceRecord, LocalJudge, evidence_for, record_evidence
from ._ingest import IngestResult
from ._merkle import (
    inclusion_proof,
    leaf_hash,
    merkle_root,
    node_hash,
    verify_inclusion,
)
from ._queries import ReceiptRow, list_receipts, load_key
from ._remote import RemoteJudge
from ._roots import fetch_root, publish_root, root_problem, root_record
from ._service import LedgerService, ServiceConfig
from ._settle import (
    Balance,
    FlatPrice,
    PerExpertPrice,
    Pricing,
    Statement,
    balances,
    credits,
)
from ._settlement import (
    PeerBalance,
    Proof,
    check_proof,
    peer_balance,
    prove,
    settle_epoch,
    stored_statement,
)
from ._standing import FundedGate, GateConfig
from ._store import HeadInfo, Ledger, StoreConfig
from ._submitter import ReceiptSubmitter, SubmitterConfig
from ._verify import Problem, VerifyReport, verify_chain

__all__ = [
    # store
    "Ledger", "StoreConfig", "HeadInfo", "IngestResult", "Reason", "ModelShape", "receipt_id", "entry_hash",
    "GENESIS_HASH", "DatabaseMissing", "LedgerCorrupt", "ReceiptRow", "list_receipts", "load_key",
    # verification
    "verify_chain", "VerifyReport", "Problem",
    # settlement and proofs
    "Pricing", "FlatPrice", "PerExpertPrice", "Balance", "Statement", "balances", "credits", "settle_epoch",
    "stored_statement", "Proof", "prove", "check_proof", "PeerBalance", "peer_balance",
    "merkle_root", "inclusion_proof", "verify_inclusion", "leaf_hash", "node_hash",
    # settlement roots in the DHT
    "publish_root", "fetch_root", "root_problem", "root_record",
    # service and submitter
    "LedgerService", "ServiceConfig", "ReceiptSubmitter", "SubmitterConfig", "FundedGate", "GateConfig",
    # double-entry credit
    "GrantRecord", "Standing",
    # audits
    "AuditConfig", "AuditRunner", "AuditSample", "AuditVerdict", "LocalJudge", "RemoteJudge", "reexecute",
    "check_sample", "EvidenceRecord", "record_evidence", "evidence_for",
]
