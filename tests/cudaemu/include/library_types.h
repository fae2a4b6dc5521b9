// The CUDA emulation's library_types.h: the data types the emulated cuBLAS and cuBLASLt accept,
// with CUDA's numeric values. Types not listed are not emulated.
#ifndef CUDAEMU_LIBRARY_TYPES_H
#define CUDAEMU_LIBRARY_TYPES_H

typedef enum cudaDataType_t {
  CUDA_R_32F = 0,
  CUDA_R_64F = 1,
  CUDA_R_16F = 2,
  CUDA_R_8I = 3,
  CUDA_R_32I = 10,
  CUDA_R_16BF = 14
} cudaDataType;
typedef cudaDataType cudaDataType_t;

#endif
