"""An episode's frames, from the bytes a request names to the JPEGs sent: decode (video file, base64
images, .npy, multipart parts) within the memory budget, sample, resize, encode; the frame store.
Blocking CPU work, run on the media executor's threads."""
