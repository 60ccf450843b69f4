"""The remote-folder tests' GCS: gcp-storage-emulator, whose downloads also carry the object's generation
header (x-goog-generation), which tensorstore's GCS driver reads to make its conditional writes.

    python -m tests.gcs_emulator start --port PORT --in-memory --default-bucket=NAME
"""

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

if __name__ == "__main__":
    from gcp_storage_emulator.__main__ import main

    main()
