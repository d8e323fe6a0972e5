"""safejson refuses a document over its byte bound before parsing it."""

import pytest

from ckptverify.errors import JSONError
from ckptverify.safeparse import safejson


def test_document_over_max_bytes_is_refused() -> None:
    with pytest.raises(JSONError, match="more than the 8 this tool reads"):
        safejson.loads(b'{"a": 12}', max_bytes=8)
    assert safejson.loads(b'{"a": 1}', max_bytes=8) == {"a": 1}
