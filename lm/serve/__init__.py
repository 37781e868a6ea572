"""An OpenAI-compatible HTTP server for any checkpoint: completions and chat, streaming, continuous batching.

    python -m lm.serve RUN_DIR|hf:DIR|s3://...|gs://... [--host 127.0.0.1] [--port 8000] [--max-batch 16]

The package, one job a module:
    scheduler.py  continuous batching: requests' rows into the slots of one decoding batch (lm.sampling.slots)
    api.py        the OpenAI API's bodies: requests checked into rows, responses, stream chunks, errors
    app.py        the HTTP layer: routes on Starlette, server-sent events, disconnects, errors as JSON
    cli.py        the python -m lm.serve command line: load, warm up, serve on uvicorn
"""
