"""Trinity-RFT plugin: experience buffers whose path is expbuf://HOST:PORT/TABLE live in expbuf.

Trinity loads every module of the directories in TRINITY_PLUGIN_DIRS; point it at
`python -c "import expbuf.client.trinity as t; print(t.plugin_dir())"`.
"""

from expbuf.client.trinity import install

install()
