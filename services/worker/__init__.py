"""Worker plumbing shared by the prefill and decode services: config, lifecycle, load reports,
drain (`base`), the engine interface they serve through (`api`) and the embedded engine behind
it (`embedded`). `common` stays free of engines and the store; this package is where they meet.
"""
