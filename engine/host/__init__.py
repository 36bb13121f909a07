"""The host side (numpy, no torch): sampling parameters, per-request columns, the request table, the row ledger."""
