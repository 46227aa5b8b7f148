"""`train.py --plan TOPOLOGY` (docs/plan.md): accelerators.py, the chips and slices and what a program compiled
for them needs per chip (it imports neither training nor decoding); report.py, the plans and the table.
Needs `pip install -r requirements-aot.txt`."""
