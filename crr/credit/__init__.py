"""Step credit measured against ground truth (issue 29): `crr credit audit` (crr.credit.audit) and the
statistics it reports (crr.credit.stats)."""
