//! Durability: every `201` survives a SIGKILL of the real binary, and the ledger still balances.
