/* `fmattn kernel IN.h5 OUT.h5` (SPEC §8.3): one attention op forward+backward on user tensors. */
#ifndef FMATTN_KERNEL_FILE_H
#define FMATTN_KERNEL_FILE_H

/* Returns the exit status; errors end the process with a message. */
int kernel_file_run(const char *in_path, const char *out_path);

#endif
