//! Recording readers and windows: flat binary, SpikeGLX, Open Ephys; Kilosort4 batching.
