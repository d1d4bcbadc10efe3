"""The CSV files benchmarks and studies write beside their markdown reports."""
import csv


def write_csv(path, rows):
    """``rows`` (dicts) to ``path`` with one header: every key that occurs, in first-seen order.
    Writes nothing when there are no rows."""
    if not rows:
        return
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
