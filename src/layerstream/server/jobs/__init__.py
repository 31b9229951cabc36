"""Asynchronous generation jobs: OpenAI's `/v1/videos` job API and the same life cycle for images.

`requests` parses a job's body, `manager` queues it on the service's worker and follows it, `events` carries
its progress and previews to server-sent event streams, `previews` draws those from the latents, `store`
keeps every job and its output in SQLite and files under the data folder (each output encoded with its
settings inside, by `layerstream.outputs`), and `routes` puts it all on HTTP.
"""
