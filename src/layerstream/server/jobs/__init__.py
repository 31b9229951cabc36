"""Asynchronous generation jobs: OpenAI's `/v1/videos` job API and the same life cycle for images.
`requests` parses a body, `manager` queues and follows a job, `events` and `previews` stream its progress,
`store` keeps it in SQLite and files, and `routes` puts it on HTTP."""
