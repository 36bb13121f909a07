"""The host side: sampling parameters, per-request columns, the row ledger, the persistent batch."""
