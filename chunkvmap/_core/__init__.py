"""The core: chunked evaluation of a traced chunk, its loop, layouts and memory.

Nothing here imports a front end (`chunkvmap._transforms`,
`chunkvmap._quantities`) or an adapter; data flows down into these modules, never
back up.
"""
