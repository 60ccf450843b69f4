"""The remote-folder tests' GCS: gcp-storage-emulator, whose downloads also carry the object's generation
header (x-goog-generation), which tensorstore's GCS driver reads to make its conditional writes, and which
answers GCS's moveTo (a rename within a bucket).

    python -m tests.gcs_emulator start --port PORT --in-memory --default-bucket=NAME
"""

from http import HTTPStatus

from gcp_storage_emulator import settings
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:  # not found: the download answered 404 already
        return
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj["metageneration"])


objects.download = download  # before the server's routes are built from it

from gcp_storage_emulator import server  # noqa: E402 (after the patch above)


def move(request, response, storage, *args, **kwargs):
    """gcsfs renames (meshlm's checkpoint marker, say) by moveTo first. The emulator answered it 501, which
    gcsfs retried for 33 s before it fell back to copy and delete."""
    bucket, source = request.params["bucket_name"], request.params["object_id"]
    try:
        moved = objects._copy(request.base_url, storage, bucket, source, bucket, request.params["dest_object_id"])
    except NotFound:
        response.status = HTTPStatus.NOT_FOUND
        return
    objects._delete(storage, bucket, source)
    response.json(moved)


MOVE = r"/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/(?P<dest_object_id>.*[^/]+)$"
# before the routes of a plain object, which would take the whole path for an object's name
server.HANDLERS = tuple((rf"^{prefix}{MOVE}", {server.POST: move}) for prefix in (settings.API_ENDPOINT, "")) + (
    server.HANDLERS
)

if __name__ == "__main__":
    from gcp_storage_emulator.__main__ import main

    main()
