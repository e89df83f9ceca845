"""The wire contract of expbuf, generated from proto/expbuf/v1/*.proto."""
