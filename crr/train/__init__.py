"""The CRR trainer on TRL: selectors, proposals, advantage estimators, ledger, tuples and the trainer."""
