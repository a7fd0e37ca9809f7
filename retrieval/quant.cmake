# kvr::retrieval_quant: ParisKV and A2ATS (codebooks, the calibration file format).
# Built only together with kvr::retrieval_core, whose interface it implements.
if(TARGET kvr_retrieval_core)
  kvr_add_library(retrieval_quant
    SOURCES src/srht.cc src/pariskv_codes.cc src/pariskv.cc src/codebook.cc src/a2ats.cc
            src/pariskv_a2ats_register.cc
    INCLUDES include
    PUBLIC kvr::retrieval_core kvr::common absl::status absl::statusor absl::strings
    PRIVATE PkgConfig::OPENBLAS absl::str_format)
endif()

# kvr::retrieval_calibrate: A2ATS calibration on the model runtime (records Q/K through the
# attention seam). Separate so that kvr::retrieval_quant does not depend on the runtime.
if(TARGET kvr_retrieval_quant AND TARGET kvr_model)
  kvr_add_library(retrieval_calibrate
    SOURCES src/calibration.cc
    PUBLIC kvr::retrieval_quant kvr::model
    PRIVATE absl::strings absl::str_format)
endif()

if(TARGET kvr_retrieval_quant)
  kvr_add_test(retrieval_quant_test
    SOURCES tests/srht_test.cc tests/pariskv_test.cc tests/codebook_test.cc tests/a2ats_test.cc
    LIBS kvr::retrieval_quant
    INCLUDES src tests)
endif()

if(TARGET kvr_retrieval_calibrate)
  kvr_add_test(retrieval_calibration_test
    SOURCES tests/calibration_test.cc
    LIBS kvr::retrieval_calibrate kvr::model kvr::common
    INCLUDES src tests)
endif()
